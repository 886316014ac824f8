"""Samples stored in WebDataset-format tar shards, read by index, from any fsspec URL.

A shard is a plain (uncompressed) tar file. Its members are grouped into samples by key,
the member name up to the first dot of its base name: ``000017.jpg`` and ``000017.cls``
are the ``.jpg`` and ``.cls`` fields of sample ``000017`` (wids's sample dict). A shard
list names the shards and how many samples each holds, in the JSON shape of webdataset's
``wids``::

    {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": "train",
     "shardlist": [{"url": "shard-000000.tar", "nsamples": 1000, "filesize": 3225600},
                   ...]}

Relative URLs are resolved against the JSON file's folder (or its ``"base"``).

* :class:`ShardListDataset` gives map-style access (``ds[i]``) to the samples. A remote
  shard is downloaded whole, once per host, into a local cache directory the first time a
  sample of it is read; samples are then read from local disk by byte offset.
* :class:`DistributedChunkedSampler` gives each rank an equal share of the indices in
  contiguous chunks (a shard each, by default), shuffled per epoch, so that each process
  reads few shards at a time.
* :func:`write_shards` turns an existing dataset (a torchvision ``ImageFolder``, an
  ``S3ImageFolder``, a list of dicts, any iterable) into shards and a shard list.

Why shards: one S3 request per sample costs about 1 ms of client CPU and a round trip,
which caps a 2-core machine near 600 to 1,000 samples per second (see ``docs/data.md``).
One request per shard of a thousand samples removes that limit.

The code is split along the same seams as wids': shard lists (``_specs``), the tar index
and reader (``_tar``), the dataset (``_dataset``, with its files in ``_shard_files``, its
shard order and prefetch in ``_shard_order``, its decoding in ``_codecs``), the sampler
(``_sampler``, talking to the dataset through ``_protocols.ShardedDataset``) and the writer
(``_writer``). This module is their public face.
"""

from __future__ import annotations

from dask_ddp.data._codecs import DEFAULT_DECODERS
from dask_ddp.data._dataset import ShardListDataset
from dask_ddp.data._sampler import DistributedChunkedSampler
from dask_ddp.data._writer import write_shards

__all__ = [
    "DEFAULT_DECODERS",
    "DistributedChunkedSampler",
    "ShardListDataset",
    "write_shards",
]
