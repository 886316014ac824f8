"""``python -m dask_ddp``: the command line (:mod:`dask_ddp._client.cli`)."""

import sys

from ._client.cli import main

if __name__ == "__main__":
    sys.exit(main())
