"""Datasets that read remote data fast enough to keep the GPU fed.

* :class:`S3ImageFolder`: torchvision ``ImageFolder`` over an S3 prefix, a drop-in for
  dask-pytorch-ddp's class of the same name (``s3_bucket=``/``s3_prefix=`` still work).
* :class:`FileDataset`: one file per sample on any fsspec filesystem, with your decode
  function.
* :class:`ShardListDataset`: samples in WebDataset-format tar shards, each shard
  downloaded once per host into a size-limited cache; :class:`DistributedChunkedSampler`
  reads them shard by shard on every rank; :func:`write_shards` writes them.
* :class:`CollectionSource` and :class:`DatasetShard`: a dask.dataframe, bag or array passed
  to ``launch(..., datasets={"train": ddf})``, split evenly between the ranks and read
  worker to worker with :func:`dask_ddp.get_dataset_shard`.

Both list once, fetch a batch's objects concurrently, retry transient errors, create one
client per process, pickle for spawn-started DataLoader workers and Dask, and can keep a
host-local disk cache (``cache_dir=``). See ``docs/data.md``.
"""

from dask_ddp.data._errors import (
    CorruptDataError,
    DataNotFoundError,
    MissingFieldError,
    SampleFetchError,
    ShardListError,
    StorageAccessError,
)
from dask_ddp.data.cache import LocalCache
from dask_ddp.data.collections import (
    CollectionSource,
    DatasetComputeError,
    DatasetNotFoundError,
    DatasetPartitionLostError,
    DatasetShard,
    DatasetTooSmallError,
    UnsupportedCollectionError,
)
from dask_ddp.data.s3 import IMG_EXTENSIONS, FileDataset, S3ImageFolder, decode_image
from dask_ddp.data.shards import (
    DEFAULT_DECODERS,
    DistributedChunkedSampler,
    ShardListDataset,
    write_shards,
)

__all__ = [
    "DEFAULT_DECODERS",
    "IMG_EXTENSIONS",
    "CollectionSource",
    "CorruptDataError",
    "DataNotFoundError",
    "DatasetComputeError",
    "DatasetNotFoundError",
    "DatasetPartitionLostError",
    "DatasetShard",
    "DatasetTooSmallError",
    "DistributedChunkedSampler",
    "FileDataset",
    "LocalCache",
    "MissingFieldError",
    "S3ImageFolder",
    "SampleFetchError",
    "ShardListDataset",
    "ShardListError",
    "StorageAccessError",
    "UnsupportedCollectionError",
    "decode_image",
    "write_shards",
]
