"""PyTorch Lightning, reporting to dask_ddp: a logger for metrics, a callback for checkpoints.

Add :class:`DaskDDPLogger` to the ``Trainer`` and what the module logs with
``self.log(...)`` reaches :attr:`Job.metrics <dask_ddp.Job.metrics>`, the live view and
``launch(on_report=...)``, from every rank (Lightning calls a logger on each rank; its own
file loggers write on rank 0 only). Outside a dask_ddp rank it logs nothing and says so once.

Add :class:`DaskDDPCheckpoint` and every checkpoint the Trainer saves (its
``ModelCheckpoint``, ``trainer.save_checkpoint``) also goes to the job's ``checkpoint_dir``
through :func:`dask_ddp.save_checkpoint`, so ``Job.checkpoints`` lists it and a restarted
or resized job resumes from it with ``ckpt_path=DaskDDPCheckpoint.resume_path()``.

Examples
--------
>>> from dask_ddp.integrations.lightning import DaskDDPCheckpoint, DaskDDPLogger
>>> trainer = L.Trainer(                                    # doctest: +SKIP
...     logger=DaskDDPLogger(), callbacks=[DaskDDPCheckpoint()], strategy="ddp", ...
... )
>>> trainer.fit(model, data, ckpt_path=DaskDDPCheckpoint.resume_path())  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from ..errors import NotInRankError
from ._values import send

__all__ = ["DaskDDPCheckpoint", "DaskDDPLogger"]

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
        if not send(metrics, step, self._prefix) and not self._outside_said:
            self._outside_said = True
            logger.warning(
                "DaskDDPLogger outside a dask_ddp rank: metrics are not sent anywhere "
                "(run the script with dask_ddp.launch_script or python -m dask_ddp)"
            )


class DaskDDPCheckpoint(Callback):
    """Sends each checkpoint the Trainer saves to :func:`dask_ddp.save_checkpoint`.

    Lightning builds the checkpoint on every rank and calls this hook on each, so the call
    happens on every rank as dask_ddp asks (rank 0 writes; an elastic job may stop there to
    grow). The file is Lightning's own checkpoint, at the job's ``checkpoint_dir`` as
    ``checkpoint-<global step>.pt``: Lightning resumes from it by URL (any fsspec URL).
    Outside a dask_ddp rank, or in a job without ``checkpoint_dir``, it does nothing.

    Examples
    --------
    >>> ckpt = ModelCheckpoint(every_n_train_steps=100)                   # doctest: +SKIP
    >>> trainer = L.Trainer(callbacks=[ckpt, DaskDDPCheckpoint()], ...)   # doctest: +SKIP
    >>> trainer.fit(model, data, ckpt_path=DaskDDPCheckpoint.resume_path())  # doctest: +SKIP
    """

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        from .. import save_checkpoint
        from ..errors import CheckpointDirMissingError

        try:
            save_checkpoint(checkpoint, step=int(trainer.global_step))
        except (NotInRankError, CheckpointDirMissingError) as exc:
            logger.debug("DaskDDPCheckpoint: not forwarded (%s)", exc)

    @staticmethod
    def resume_path() -> str | None:
        """The job's newest checkpoint, for ``trainer.fit(..., ckpt_path=)``: None on a
        job's first attempt, without ``checkpoint_dir``, or outside a dask_ddp rank."""
        from .._rank.context import _latest_checkpoint_url

        try:
            return _latest_checkpoint_url()
        except NotInRankError:
            return None
