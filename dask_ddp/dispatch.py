"""dask-pytorch-ddp's ``dispatch`` module, kept: ``from dask_ddp import dispatch``.

The launch itself lives on the client's side of the package
(:mod:`dask_ddp._client.launch`); this module is the name code written for
dask-pytorch-ddp imports.

Examples
--------
>>> import dask_ddp
>>> from dask_ddp import dispatch
>>> dispatch.run is dask_ddp.run
True
"""

from ._client.launch import launch, launch_script, run

__all__ = ["launch", "launch_script", "run"]
