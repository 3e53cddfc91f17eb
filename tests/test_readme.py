"""The README's examples run as written.

The rule: a block fenced exactly ```python runs on a CPU, as it stands, in a fresh namespace; a
block that needs GPUs or several processes says so after the language (```python torchrun) and
is not run here.
"""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<code>.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def _blocks(info: str) -> list[str]:
    return [m["code"] for m in FENCE.finditer(README.read_text()) if m["info"].strip() == info]


CPU_BLOCKS = _blocks("python")


def test_the_readme_has_cpu_examples():
    assert len(CPU_BLOCKS) >= 2, "expected the quickstart and the functional example as ```python blocks"


@pytest.mark.parametrize("code", CPU_BLOCKS, ids=[f"block{i}" for i in range(len(CPU_BLOCKS))])
def test_readme_block_runs_on_cpu(code, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a reader's plain CPU: the reference backend
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})


def test_readme_lines_stay_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"
