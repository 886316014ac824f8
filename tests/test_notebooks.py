"""Every notebook in notebooks/ runs end to end (nbclient), shows its live view, and
gets its metrics back. The notebooks are stored without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def test_notebooks_are_found_and_stored_without_outputs() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01-quickstart.ipynb",
        "02-s3-transfer-learning.ipynb",
    ]
    for path in NOTEBOOKS:
        assert not _outputs(nbformat.read(path, as_version=4)), f"{path.name} has outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = _outputs(nb)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # The live view rendered: a widget, or the self-updating HTML display.
    views = [
        o
        for o in outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
        or "dask_ddp" in str(o.get("data", {}).get("text/html", ""))
    ]
    assert views, "the job's live view did not render"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    records = int(text.split("records: ")[1].split()[0].rstrip(","))
    assert records > 0, "no metrics arrived"
