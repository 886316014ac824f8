"""Datasets that read remote data fast enough to keep the GPU fed.

* :class:`S3ImageFolder`: torchvision ``ImageFolder`` over an S3 prefix, a drop-in for
  dask-pytorch-ddp's class of the same name (``s3_bucket=``/``s3_prefix=`` still work).
* :class:`FileDataset`: one file per sample on any fsspec filesystem, with your decode
  function.

Both list once, fetch a batch's objects concurrently, retry transient errors, create one
client per process, pickle for spawn-started DataLoader workers and Dask, and can keep a
host-local disk cache (``cache_dir=``). See ``docs/data.md``.
"""

from dask_ddp.data._errors import (
    CorruptSampleError,
    DataNotFoundError,
    NoSamplesError,
    SampleFetchError,
)
from dask_ddp.data.cache import LocalCache
from dask_ddp.data.s3 import IMG_EXTENSIONS, FileDataset, S3ImageFolder, decode_image

__all__ = [
    "IMG_EXTENSIONS",
    "CorruptSampleError",
    "DataNotFoundError",
    "FileDataset",
    "LocalCache",
    "NoSamplesError",
    "S3ImageFolder",
    "SampleFetchError",
    "decode_image",
]
