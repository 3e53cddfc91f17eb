"""Gluon across Triton releases: the probe that decides whether mok's Gluon kernels run, and
the fallback to the plain Triton kernels where they cannot (Gluon hidden, or a probe that does
not compile): every precision still matches the reference, with one warning that names the
Triton version and what falls back."""

import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import triton

from mok.kernels import gluon_api
from mok.kernels.gemm import hopper_common

# A layer through the triton backend with Gluon unimportable: forward and backward of every
# precision against the reference, on the GPU if there is one, else under the interpreter.
_WITHOUT_GLUON = textwrap.dedent("""
    import builtins, warnings
    _import = builtins.__import__
    def _hiding_gluon(name, globals=None, *args, **kwargs):  # from mok's Gluon module alone: Triton needs it
        if name.startswith("triton.experimental") and (globals or {}).get("__name__") == "mok.kernels.gluon_api":
            raise ImportError(f"No module named {name!r} (hidden by the test)")
        return _import(name, globals, *args, **kwargs)
    builtins.__import__ = _hiding_gluon
    import torch
    import mok
    from mok.kernels import gluon_api
    from mok.testing import make_inputs, assert_close_to_reference
    assert gluon_api.unavailable_reason(torch.device("cpu"), False).startswith("Gluon does not import"), "Gluon still imports"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for precision in ("bf16", "mxfp8", "fp8_block"):
            inp = make_inputs(37, 256, 128, 4, 2, 128, seed=5, device=device)
            results = {}
            for backend in ("triton", "reference"):
                x = inp.x.clone().requires_grad_()
                config = mok.MoKConfig(backend=backend, precision=precision, strict=True)
                out = mok.moe(x, inp.topk_ids, inp.topk_weights, *inp.weights, config=config)
                out.float().square().sum().backward()
                results[backend] = out, x.grad
            for name, actual, expected in zip(("out", "d_x"), results["triton"], results["reference"]):
                assert_close_to_reference(actual, expected, precision, name=name, context=precision)
    print("warnings:", sorted({str(w.message) for w in caught if "falls back" in str(w.message)}))
""")


def test_layer_runs_through_the_triton_kernels_without_gluon():
    env_note = "the GPU" if torch.cuda.is_available() else "the interpreter"
    result = subprocess.run([sys.executable, "-c", _WITHOUT_GLUON], capture_output=True, text=True)
    assert result.returncode == 0, f"without Gluon on {env_note}:\n{result.stdout}\n{result.stderr[-4000:]}"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        assert f"Triton {triton.__version__}: Gluon does not import" in result.stdout, result.stdout


def test_probe_compiles_for_hopper_with_this_triton():
    """The probe kernel (every Gluon construct the kernels use) builds for sm_90a on any machine."""
    assert gluon_api._probe((9, 0)) is None


def test_a_failing_probe_falls_back_with_one_warning(monkeypatch):
    reason = "a Gluon probe kernel does not compile (CompilationError: test)"
    monkeypatch.setattr(gluon_api, "unavailable_reason", lambda device, hopper_kernels: reason)
    gluon_api._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not gluon_api.usable(torch.device("cuda"), "the warp-specialized Hopper GEMMs")
        assert not gluon_api.usable(torch.device("cuda"), "the warp-specialized Hopper GEMMs")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert f"Triton {triton.__version__}" in messages[0] and "the warp-specialized Hopper GEMMs" in messages[0]
    assert "falls back to its plain Triton kernel" in messages[0]
    gluon_api._warn_once.cache_clear()


@pytest.mark.gpu
def test_a_failing_probe_keeps_hopper_on_the_triton_gemms(monkeypatch):
    monkeypatch.setattr(gluon_api, "unavailable_reason", lambda device, hopper_kernels: "test")
    gluon_api._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="falls back"):
        assert not hopper_common.warp_specialized_available(torch.device("cuda"))
    gluon_api._warn_once.cache_clear()


def test_the_probe_runs_outside_a_compiled_graph(monkeypatch):
    """Under torch.compile(fullgraph=True) the probe and its warning are host work that dynamo
    must not trace (building a kernel calls untraceable builtins): their result enters the graph
    as a constant."""
    def probe(capability):
        threading.get_ident()  # what dynamo cannot trace, as triton.compile's internals
        return f"a Gluon probe kernel does not compile on sm_{capability[0]}{capability[1]}"

    monkeypatch.setattr(gluon_api, "_probe", probe)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    gluon_api._warn_once.cache_clear()

    def step(x):
        hopper = gluon_api.usable(torch.device("cuda", 0), "the warp-specialized Hopper GEMMs", hopper_kernels=True)
        return x + 1 if hopper else x - 1

    with pytest.warns(RuntimeWarning, match="does not compile on sm_90"):
        out = torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(3))
    assert torch.equal(out, torch.full((3,), -1.0))
    gluon_api._warn_once.cache_clear()
