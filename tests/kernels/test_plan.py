"""The kernel plan chooses what the module constants chose before it: every chooser's configs on the
interpreter, a CUDA GPU and (simulated) Hopper, as recorded in `kernel_configs.json`."""

import json

import pytest

from tests.kernels.kernel_configs import FIXTURE, legacy_constants, recorded

RECORDED = json.loads(FIXTURE.read_text())


def test_choosers_give_the_recorded_configs():
    got = recorded()
    want = {key: value for key, value in RECORDED.items() if not key.startswith("constant|")}
    assert set(got) == set(want)
    changed = {key: (want[key], got[key]) for key in want if json.loads(json.dumps(got[key])) != want[key]}
    assert not changed, f"{len(changed)} configs changed, e.g. {next(iter(changed.items()))}"


@pytest.mark.parametrize("key", sorted(key for key in RECORDED if key.startswith("constant|")))
def test_constants_keep_their_values(key):
    assert json.loads(json.dumps(legacy_constants()[key])) == RECORDED[key]
