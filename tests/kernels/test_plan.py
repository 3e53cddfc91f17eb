"""The kernel plan chooses what the module constants chose before it: every chooser's configs on the
interpreter, a CUDA GPU and (simulated) Hopper, as recorded in `kernel_configs.json`."""

import dataclasses
import json

import pytest
import torch

from mok.kernels.common import interpreting
from mok.kernels.plan import GENERIC, HOPPER, kernel_plan, override
from tests.kernels.kernel_configs import FIXTURE, plan_constants, recorded

RECORDED = json.loads(FIXTURE.read_text())


def test_choosers_give_the_recorded_configs():
    got = recorded()
    want = {key: value for key, value in RECORDED.items() if not key.startswith("constant|")}
    assert set(got) == set(want)
    changed = {key: (want[key], got[key]) for key in want if json.loads(json.dumps(got[key])) != want[key]}
    assert not changed, f"{len(changed)} configs changed, e.g. {next(iter(changed.items()))}"


@pytest.mark.parametrize("plan", [HOPPER, GENERIC], ids=["hopper", "generic"])
@pytest.mark.parametrize("key", sorted(key for key in RECORDED if key.startswith("constant|")))
def test_plans_hold_the_old_constants(key, plan):
    """Both plans: what the other GPUs and the interpreter took from the same constants."""
    assert json.loads(json.dumps(plan_constants(plan)[key])) == RECORDED[key]


def test_hopper_and_generic_differ_only_in_the_warp_specialized_gemms():
    assert dataclasses.replace(HOPPER, warp_specialized=False) == GENERIC


def test_interpreter_and_cpu_get_the_generic_plan():
    assert kernel_plan(torch.device("cpu")) is GENERIC
    if interpreting():
        assert kernel_plan() is GENERIC


def test_override_replaces_fields_and_restores_them():
    before = kernel_plan()
    with override(gemm_group_m=16):
        with override(split_last_wave=False):
            assert (kernel_plan().gemm_group_m, kernel_plan().split_last_wave) == (16, False)
        assert (kernel_plan().gemm_group_m, kernel_plan().split_last_wave) == (16, before.split_last_wave)
    assert kernel_plan() == before
    with pytest.raises(ValueError, match="KernelPlan has no field 'nope'"):
        with override(nope=1):
            pass
    assert kernel_plan() == before
