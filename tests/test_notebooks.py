"""Every notebook in notebooks/ runs end to end (nbclient), shows its live view, and
gets its metrics back. The notebooks are stored without outputs."""

from __future__ import annotations

import os
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
        "03-sweep.ipynb",
    ]
    for path in NOTEBOOKS:
        assert not _outputs(nbformat.read(path, as_version=4)), f"{path.name} has outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
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
    if path.name == "01-quickstart.ipynb":
        _exports_with_the_curve(nb)


def _exports_with_the_curve(nb: nbformat.NotebookNode) -> None:
    """`jupyter nbconvert --to html` of the executed quick start shows the job's final
    state, loss curve included, without a kernel or the widget's JavaScript. The notebook
    is exported as JupyterLab saves it: without the widgets' state (JupyterLab keeps it
    only with "Save Widget State Automatically" on), so nbconvert, GitHub and nbviewer fall
    back to the static HTML each displayed job carries beside its widget."""
    from nbconvert import HTMLExporter

    nb.metadata.pop("widgets", None)
    body, _ = HTMLExporter().from_notebook_node(nb)
    artifacts = Path(os.environ.get("DASK_DDP_ARTIFACTS", Path(__file__).parents[1] / "artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "01-quickstart.html").write_text(body)  # a test artefact, for people
    svg = body[body.index("<svg") : body.index("</svg>")]
    assert "loss" in svg and "<polyline" in svg  # the curve, with its metric's name
    assert "dask_ddp job" in body and "succeeded" in body  # the job's final state
