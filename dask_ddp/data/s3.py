"""Map-style datasets that read samples from S3 or any other fsspec filesystem.

:class:`FileDataset` is the general one: one object (file) per sample, a user decode
function, any fsspec URL (``s3://``, local paths, ``gs://``, ...). :class:`S3ImageFolder` is
a thin layer over it with :class:`torchvision.datasets.ImageFolder` semantics.

What makes them fast and robust:

* The objects are listed once, at construction, with one paginated listing (S3
  ``ListObjectsV2``, any number of keys).
* The filesystem client is created lazily, once per process: it is dropped when the
  dataset is pickled (spawn-started DataLoader workers, Dask) and recreated when the
  process id changes (fork-started workers). Connections are kept alive and reused.
* ``__getitems__`` fetches a whole batch concurrently (``concurrency=`` requests at a
  time) on fsspec's IO loop, so a batched ``DataLoader`` waits for one round trip per
  batch instead of one per sample.
* Transient S3 errors (5xx, throttling, reset connections) are retried with exponential
  backoff and jitter (botocore's "standard" retry mode, ``retries=`` extra attempts).
* ``cache_dir=`` keeps a copy of each sample on local disk, shared by every process on
  the host (see :mod:`dask_ddp.data.cache`), so a second epoch reads local disk.

The code lives in :mod:`dask_ddp.data._files` (FileDataset and its store),
:mod:`dask_ddp.data._imagefolder` (S3ImageFolder, whose loader :func:`decode_image` is in
:mod:`dask_ddp.data._decode`) and :mod:`dask_ddp.data._fsclient` (per-process fsspec
clients); this module is their public face.
"""

from __future__ import annotations

from dask_ddp.data._decode import IMG_EXTENSIONS, decode_image
from dask_ddp.data._files import FileDataset
from dask_ddp.data._imagefolder import S3ImageFolder

__all__ = ["IMG_EXTENSIONS", "FileDataset", "S3ImageFolder", "decode_image"]
