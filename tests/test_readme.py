"""The README's quick start runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


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
