"""An HF accelerate tracker that sends ``accelerator.log(...)`` values to the dask_ddp client.

Examples
--------
>>> from dask_ddp.integrations.accelerate import DaskDDPTracker      # doctest: +SKIP
>>> accelerator = Accelerator(log_with=[DaskDDPTracker()])          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from accelerate.tracking import GeneralTracker

from ._values import send

__all__ = ["DaskDDPTracker"]


class DaskDDPTracker(GeneralTracker):
    """Forwards ``accelerator.log(values, step=)`` to :func:`dask_ddp.report`.

    ``Accelerator.log`` calls trackers on the main process only, so the values arrive as
    rank 0's records. Strings are left out (``report()`` takes numbers). Outside a dask_ddp
    rank nothing is sent.

    Examples
    --------
    >>> accelerator = Accelerator(log_with=[DaskDDPTracker()])  # doctest: +SKIP
    >>> accelerator.init_trackers("run1")                         # doctest: +SKIP
    >>> accelerator.log({"train_loss": loss.item()}, step=step)   # doctest: +SKIP
    """

    name = "dask_ddp"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self) -> None:
        super().__init__()

    @property
    def tracker(self) -> None:
        """There is no run object: the records go to the client's :class:`dask_ddp.Job`."""
        return None

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Hyperparameters are not metrics: nothing is sent."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Send the numeric values as one record."""
        # Outside dask_ddp (accelerate launch) nothing is sent; its other trackers log.
        send(values, step)
