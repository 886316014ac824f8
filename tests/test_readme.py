"""The README's quick start runs as written, and BENCHMARKS.md says where each figure comes
from."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BENCHMARKS = README.with_name("BENCHMARKS.md")


@pytest.mark.slow
def test_quick_start_runs(tmp_path: Path) -> None:
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert len(block.splitlines()) <= 25
    script = tmp_path / "quickstart.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[0, 1]"


def _sections(text: str) -> list[str]:
    return re.split(r"(?m)^(?=## )", text)[1:]


def test_every_benchmarks_section_names_its_commit() -> None:
    """A figure without the commit it was measured on is not quoted: each section of
    BENCHMARKS.md names at least one."""
    commit = re.compile(r"`[0-9a-f]{7,40}`")
    missing = [
        s.split("\n", 1)[0] for s in _sections(BENCHMARKS.read_text()) if not commit.search(s)
    ]
    assert not missing, f"BENCHMARKS.md sections without a commit: {missing}"
    assert len(_sections("## a `0123abc`\n## b\n")) == 2
