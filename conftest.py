"""The doctests of an optional integration skip, with the reason, when its framework is
missing (``--doctest-modules`` would otherwise fail to import the module: a collection
error). Its tests skip the same way, with ``pytest.importorskip`` in tests/."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path

import pytest

_INTEGRATIONS = Path(__file__).resolve().parent / "dask_ddp" / "integrations"
_FRAMEWORKS = {  # module under dask_ddp/integrations -> what it imports, and the extra
    "lightning.py": "lightning",
    "transformers.py": "transformers",
    "accelerate.py": "accelerate",
}


def _missing_framework(path: Path) -> str | None:
    """The framework an integration module needs and this environment lacks, if any."""
    if path.resolve().parent != _INTEGRATIONS:
        return None
    framework = _FRAMEWORKS.get(path.name)
    if framework is None or importlib.util.find_spec(framework) is not None:
        return None
    return framework


class _SkippedModule(pytest.File):
    """Stands in for the doctests of a module whose framework is missing."""

    def collect(self) -> Iterable[pytest.Item]:
        framework = _missing_framework(self.path)
        pytest.skip(f"{framework} is not installed (pip install {framework})")


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> list[pytest.Collector]:
    collectors = yield
    if _missing_framework(file_path) is None:
        return collectors
    return [_SkippedModule.from_parent(parent, path=file_path)]
