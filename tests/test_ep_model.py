"""`benchmarks/ep_model.py` runs on the CPU, counts rows as the designs define them, and its
per-route prediction stays within 15% of the measured EP = 2 step."""

import importlib.util
import pathlib

import torch

from mok.testing import make_topk_ids

_PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "ep_model.py"


def _model():
    spec = importlib.util.spec_from_file_location("ep_model", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_per_design_counted_from_topk_ids():
    model = _model()
    ids = torch.tensor([[0, 1, 4], [5, 6, 7], [2, 3, 6]])  # E 8, P 4: E_l 2
    traffic = model.count_traffic(ids, 8, 4)
    # remote routes: token 0 sends 4 (rank 2) and 1 (rank 0 holds 0, 1) -> routes to ranks != 0
    assert traffic.remote_routes == 1 + 3 + 3, traffic
    # (token, remote rank) pairs: t0 {2}, t1 {2, 3}, t2 {1, 3}
    assert traffic.remote_pairs == 1 + 2 + 2, traffic
    assert traffic.routes_per_rank == 2
    sent = model.exchange_bytes(traffic, 256, "once-per-rank", "fp8")
    assert sent["x"] == 5 * (256 + 8 + 2 * 8) and sent["y"] == 5 * 512 and sent["dx"] == 5 * (512 + 8)


def test_model_runs_and_matches_the_ep2_record(tmp_path, capsys):
    model = _model()
    ids = make_topk_ids(512, 128, 8, torch.Generator().manual_seed(0))
    path = tmp_path / "ids.pt"
    torch.save(ids, path)
    assert model.main(["--preset", "qwen3-30b", "--ep", "2,4,3", "--topk-ids", str(path)]) == 0
    assert "not divisible" in capsys.readouterr().out  # E 128 over 3 ranks
    assert model.main(["--preset", "qwen3-30b,deepseek-v3", "--ep", "2,64", "--check", "--json",
                       str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "check: qwen3-30b EP=2 per-route bf16" in out, out


def test_built_overlap_hides_the_x_dispatch_and_dx_return_and_costs_the_gemms_the_held_sms():
    """The built column: with no overlap SMs it is the serial step; at a C where the x dispatch
    fits under the gate/up GEMM's own tiles (1/P of it, with overlap_dispatch_sms) and the dx return
    under the routed wgrads, both at C programs, it hides most of them; holding many SMs slows the GEMMs beside them by
    W·C/(S − C). Without a shared expert the dOut dispatch has x's sorted copy beside it (its HBM
    bytes at the copy rate), at 32 programs and no SM held."""
    model = _model()
    preset = model.MODEL_PRESETS["qwen3-30b"]
    sent = {"x": 68_000_000, "y": 67_000_000, "d_out": 67_000_000, "dx": 67_000_000}
    serial, _ = model.step_ms(8.0, sent, 341.0, 0)
    assert abs(model.built_ms(8.0, sent, 341.0, preset, 0, 2) - serial) < 1e-9
    x_ms, dx_ms = (sent[kind] / 341e6 + model.EXCHANGE_LATENCY_MS for kind in ("x", "dx"))
    wgrad_ms = 8.0 / 3  # qwen3-30b has no shared expert: the routed wgrads are a third of the step
    own_gate_up_ms = 8.0 / 3 * 2 / 3 / 2  # P = 2: half of the gate/up GEMM, two thirds of the forward
    held = 8  # x at 8 programs (0.81 ms) fits under the own tiles (0.89 ms), dx under the wgrads
    slowed = model.SMS / (model.SMS - held)
    d_out_ms = sent["d_out"] / 341e6 + model.EXCHANGE_LATENCY_MS
    routes, received = preset.num_tokens * preset.topk, 67_000_000 // (2 * preset.hidden_size) * 2
    copy_ms = (routes + received) * preset.hidden_size * 2 / (model.HBM_GBPS * 1e6)
    assert 0 < copy_ms < d_out_ms, "the copy hides part of the dOut dispatch"
    expected = serial - dx_ms - x_ms + (wgrad_ms + own_gate_up_ms) * (slowed - 1) - copy_ms
    assert abs(model.built_ms(8.0, sent, 341.0, preset, held, 2, dispatch_sms=held) - expected) < 1e-9
    # without overlap_dispatch_sms qwen3-30b has nothing beside the x dispatch: it stays serial
    assert abs(model.built_ms(8.0, sent, 341.0, preset, held, 2) - (expected + x_ms - own_gate_up_ms * (slowed - 1))
               ) < 1e-9
    assert model.built_ms(8.0, sent, 341.0, preset, 66, 2) > serial, "half the SMs held costs more than the exchanges"


def test_built_overlap_returns_y_beside_the_own_down_tiles_at_its_own_programs():
    """overlap_return_sms C_y: the y return (serial without it) beside the down GEMM's own tiles,
    1/P of it, at C_y programs. At P = 2 and C_y = 16 it fits (0.40 ms under 0.44 ms of tiles),
    which then slow by S/(S − C_y); at C_y = 2 the return is slower than the tiles and costs more
    than serial."""
    model = _model()
    preset = model.MODEL_PRESETS["qwen3-30b"]
    sent = {"x": 68_000_000, "y": 67_000_000, "d_out": 67_000_000, "dx": 67_000_000}
    without = model.built_ms(8.0, sent, 341.0, preset, 8, 2)
    y_ms = sent["y"] / 341e6 + model.EXCHANGE_LATENCY_MS
    own_down_ms = 8.0 / 3 * 1 / 3 / 2  # P = 2: half of the down GEMM, a third of the forward
    programs = 16
    assert sent["y"] / (341e6 * programs / model.LINK_PROGRAMS) + model.EXCHANGE_LATENCY_MS < own_down_ms
    expected = without - y_ms + own_down_ms * (model.SMS / (model.SMS - programs) - 1)
    assert abs(model.built_ms(8.0, sent, 341.0, preset, 8, 2, programs) - expected) < 1e-9
    assert model.built_ms(8.0, sent, 341.0, preset, 8, 2, 2) > without, "two programs return y slower than serial"


def test_built_overlap_charges_the_measured_split_of_each_gemm():
    """A GEMM run in two launches costs the measured fraction of its time (its share of the step
    by FLOPs: gate/up 2/3, down 1/3 of the routed forward, a third of the step): the gate/up
    GEMM's with overlap_dispatch_sms, the down GEMM's with overlap_return_sms; the records load."""
    model = _model()
    preset = model.MODEL_PRESETS["qwen3-30b"]
    sent = {"x": 68_000_000, "y": 67_000_000, "d_out": 67_000_000, "dx": 67_000_000}
    cost = {"gate_up": 0.1, "down": 0.3}
    third = 8.0 / 3  # no shared expert: the routed forward is a third of the step
    for dispatch, returning, extra in ((8, 0, 0.1 * third * 2 / 3), (0, 16, 0.3 * third / 3),
                                       (8, 16, 0.1 * third * 2 / 3 + 0.3 * third / 3), (0, 0, 0.0)):
        free = model.built_ms(8.0, sent, 341.0, preset, 4, 2, returning, dispatch_sms=dispatch)
        paid = model.built_ms(8.0, sent, 341.0, preset, 4, 2, returning, "bf16", cost, dispatch)
        assert abs(paid - free - extra) < 1e-9, (dispatch, returning, paid - free, extra)
    costs = model.split_costs(model.SPLIT_RECORDS)
    measured = model.split_cost_for(costs, "qwen3-30b", 3, "fp8")
    assert set(measured) == {"gate_up", "down"} and all(v > -0.5 for v in measured.values()), measured
    assert model.split_cost_for(costs, "deepseek-v3", 2, "bf16") == costs["deepseek-v3-slice", 2, "bf16"]
    assert model.split_cost_for(costs, "qwen3-30b", 2, "nope") == {}
