"""A PyTorch Lightning logger that sends logged metrics to the dask_ddp client.

Add it to the ``Trainer`` and what the module logs with ``self.log(...)`` reaches
:attr:`Job.metrics <dask_ddp.Job.metrics>`, the live view and ``launch(on_report=...)``, from
every rank (Lightning calls a logger on each rank; its own file loggers write on rank 0
only). Outside a dask_ddp rank it logs nothing and says so once.

Examples
--------
>>> from dask_ddp.integrations.lightning import DaskDDPLogger   # doctest: +SKIP
>>> trainer = L.Trainer(logger=DaskDDPLogger(), strategy="ddp", ...)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import Logger

from ..errors import NotInRankError
from ._values import numeric_values

__all__ = ["DaskDDPLogger"]

logger = logging.getLogger(__name__)


class DaskDDPLogger(Logger):
    """Forwards ``self.log(...)`` metrics to :func:`dask_ddp.report`, with Lightning's step.

    Parameters
    ----------
    prefix : str, optional
        Put before every metric name (``"train/"``), as Lightning's own loggers allow.

    Examples
    --------
    >>> trainer = L.Trainer(logger=DaskDDPLogger(), max_epochs=3)  # doctest: +SKIP
    >>> job = dask_ddp.launch_script(client, "train_lightning.py")  # doctest: +SKIP
    >>> job.result(); job.metrics_frame().groupby("rank").train_loss.last()  # doctest: +SKIP
    """

    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self._prefix = prefix
        self._outside_said = False

    @property
    def name(self) -> str:
        return "dask_ddp"

    @property
    def version(self) -> str:
        """The dask_ddp job id inside a rank; ``"local"`` outside one."""
        from .. import get_context

        try:
            return get_context().job_id
        except NotInRankError:
            return "local"

    def log_hyperparams(
        self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any
    ) -> None:
        """Hyperparameters are not metrics: nothing is sent."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send the numeric metrics (tensors of one element, numbers) as one record."""
        from .. import report

        values = numeric_values(metrics, self._prefix)
        if not values:
            return
        try:
            report(values, step=step)
        except NotInRankError:
            if not self._outside_said:
                self._outside_said = True
                logger.warning(
                    "DaskDDPLogger outside a dask_ddp rank: metrics are not sent anywhere "
                    "(run the script with dask_ddp.launch_script or python -m dask_ddp)"
                )
