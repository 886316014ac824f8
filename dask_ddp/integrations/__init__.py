"""Bridges from training libraries to dask_ddp's metrics, each an optional import.

- :mod:`dask_ddp.integrations.lightning`: :class:`~dask_ddp.integrations.lightning.DaskDDPLogger`,
  a PyTorch Lightning logger that sends what ``self.log(...)`` logs to :func:`dask_ddp.report`,
  and :class:`~dask_ddp.integrations.lightning.DaskDDPCheckpoint`, a callback that sends the
  Trainer's checkpoints to :func:`dask_ddp.save_checkpoint`.
- :mod:`dask_ddp.integrations.transformers`:
  :class:`~dask_ddp.integrations.transformers.DaskDDPCallback`, an HF ``Trainer`` callback
  that sends its logs to :func:`dask_ddp.report` and its checkpoints to
  :func:`dask_ddp.save_checkpoint`.
- :mod:`dask_ddp.integrations.accelerate`:
  :class:`~dask_ddp.integrations.accelerate.DaskDDPTracker`, an HF accelerate tracker that
  sends what ``accelerator.log(...)`` logs.

Each module imports its library when it is imported, never before: ``import dask_ddp``
needs none of them.
"""
