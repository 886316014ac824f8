"""dask-ddp on the scheduler from its start: ``dask scheduler --preload dask_ddp.dashboard``.

``launch()`` installs the ``/ddp/`` page on any running cluster by itself. Preloading this
module on the scheduler adds what only a scheduler's start can add:

- the page is there before the first job (and for every client);
- a Bokeh panel, ``/individual-ddp-jobs``, listed in the scheduler's
  ``/individual-plots.json``, so dask-labextension offers "Individual Ddp Jobs" in
  JupyterLab's Dask side panel (needs bokeh, as Dask's own dashboard does).

Examples
--------
On the command line::

    dask scheduler --preload dask_ddp.dashboard

or in Python, ``Scheduler(preload=["dask_ddp.dashboard"])`` or
``LocalCluster(scheduler_kwargs={"preload": ["dask_ddp.dashboard"]})``.

Importing this module registers the Bokeh panel for schedulers started afterwards in the
same process: import it only as a scheduler preload.
"""

from __future__ import annotations

import logging
from typing import Any

from ._scheduler import page
from ._scheduler import plugin as _plugin
from ._shared import view

__all__ = ["dask_setup"]

logger = logging.getLogger(__name__)

PANEL = "/individual-ddp-jobs"


async def dask_setup(scheduler: Any) -> None:
    """Install dask-ddp's plugin (jobs, the ``/ddp/`` page) when the scheduler starts."""
    await _plugin.install_on(scheduler)


def _panel_html(scheduler: Any, base: str) -> str:
    """The jobs, and the newest running (else newest) job drawn as the notebook draws it."""
    plugin = scheduler.plugins.get(_plugin.PLUGIN_NAME)
    if plugin is None:
        return "dask-ddp's plugin is not installed on this scheduler."
    jobs = list(reversed(plugin.jobs.values()))
    shown = next((j for j in jobs if j.state.value == "running"), jobs[0] if jobs else None)
    html = page.list_html(plugin, base)
    return html + (view.render_html(shown.summary()) if shown is not None else "")


def _panel(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    from bokeh.models import Div

    base = "ddp/"  # relative to the panel's own page, which is beside /ddp/ under any prefix
    div = Div(text=_panel_html(scheduler, base), sizing_mode="stretch_both")

    def update() -> None:
        div.text = _panel_html(scheduler, base)

    doc.add_periodic_callback(update, 1000)
    doc.add_root(div)
    doc.title = "dask-ddp jobs"


def _register_panel() -> None:
    try:
        from distributed.dashboard import scheduler as bokeh_pages
    except ImportError:  # no bokeh: Dask's own dashboard pages are missing too
        logger.debug("no bokeh: the %s panel is not registered", PANEL)
        return
    bokeh_pages.applications.setdefault(PANEL, _panel)


_register_panel()
