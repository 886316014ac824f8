"""Bridges from training libraries to dask_ddp's metrics, each an optional import.

- :mod:`dask_ddp.integrations.lightning`: :class:`~dask_ddp.integrations.lightning.DaskDDPLogger`,
  a PyTorch Lightning logger that sends what ``self.log(...)`` logs to :func:`dask_ddp.report`.

Each module imports its library when it is imported, never before: ``import dask_ddp``
needs none of them.
"""
