"""wids's way of decoding a sample: ``transformations=`` (``"PIL"``, ``"numpy"``, functions)
applied in order to a dict of ``.ext: io.BytesIO`` fields, as ``wids.ShardListDataset``
does, so that code written for wids gets the same samples here.

The decoding follows wids 0.1.11's ``default_decoder``: ``.gz`` fields are decompressed
(the key keeps its ``.gz``), ``txt``/``text`` become str, ``cls``/``cls2`` int, ``json``
Python objects, ``npy`` arrays, ``pth``/``pt`` tensors, ``safetensors`` and ``mp``
(msgpack) their objects, and ``jpg``/``png``/``ppm``/``pgm``/``pbm``/``pnm`` images a
``PIL.Image`` as opened (``"PIL"``) or a numpy array of it (``"numpy"``). Two differences,
both for safety: ``npy`` and ``pth`` load without pickles (``allow_pickle=False``,
``weights_only=True``), and ``pkl``/``pickle`` fields stay ``io.BytesIO`` instead of being
unpickled (``pickle.load(sample[".pkl"])`` in your own transformation does what wids did).
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import numpy as np
from PIL import Image

from dask_ddp.data._codecs import (
    Sample,
    _decode_int,
    _decode_json,
    _decode_npy,
    _decode_pth,
    _decode_text,
)
from dask_ddp.data._errors import CorruptDataError

Transformations = str | Callable[[Any], Any] | Iterable[str | Callable[[Any], Any]]

_IMAGES = frozenset({"jpg", "png", "ppm", "pgm", "pbm", "pnm"})


def _decode_safetensors(data: bytes) -> Any:
    import safetensors.torch

    return safetensors.torch.load(data)


def _decode_msgpack(data: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(data, raw=False)


_BASIC: dict[str, Callable[[bytes], Any]] = {
    "txt": _decode_text,
    "text": _decode_text,
    "cls": _decode_int,
    "cls2": _decode_int,
    "json": _decode_json,
    "npy": _decode_npy,
    "pth": _decode_pth,
    "pt": _decode_pth,
    "safetensors": _decode_safetensors,
    "mp": _decode_msgpack,
}


class WidsDecoder:
    """wids's ``default_decoder(sample, format=...)``: decode a sample's fields by extension.

    Picklable, for spawn-started DataLoader workers. A field that fails to decode raises
    :class:`~dask_ddp.data.CorruptDataError` naming the shard and the sample.

    Parameters
    ----------
    format : {"PIL", "numpy"}
        Images as ``PIL.Image.open`` returns them, or as numpy arrays of them.

    Examples
    --------
    >>> WidsDecoder("PIL")({".cls": io.BytesIO(b"7"), "__key__": "000001"})
    {'.cls': 7, '__key__': '000001'}
    """

    def __init__(self, format: Literal["PIL", "numpy"] = "PIL") -> None:
        if str(format).lower() not in ("pil", "numpy"):
            raise ValueError(f"transformations= takes 'PIL' or 'numpy' as strings, got {format!r}")
        self.format = str(format).lower()

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        out = Sample(sample)
        for key, value in sample.items():
            if key.startswith("__") or "." not in key:
                continue
            try:
                out[key] = self._field(key, value)
            except Exception as err:
                where = f"{sample.get('__shard__')}#{sample.get('__key__')}{key}"
                raise CorruptDataError(where, f"{type(err).__name__}: {err}") from err
        return out

    def _field(self, key: str, value: Any) -> Any:
        exts = key.lower().split(".")
        data = value.getvalue() if isinstance(value, io.BytesIO) else value
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return value  # decoded by an earlier transformation
        ext = exts[-1]
        if ext == "gz":
            if len(exts) < 3:  # ".gz" alone: wids leaves it compressed
                return value
            data, ext = gzip.decompress(data), exts[-2]
            value = io.BytesIO(data)
        if ext in _BASIC:
            return _BASIC[ext](bytes(data))
        if ext in _IMAGES:
            image = Image.open(io.BytesIO(data))
            return np.asarray(image) if self.format == "numpy" else image
        return value

    def __repr__(self) -> str:
        return f"WidsDecoder({self.format!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WidsDecoder) and other.format == self.format

    def __hash__(self) -> int:
        return hash(("WidsDecoder", self.format))


def interpret_transformations(transformations: Transformations | None) -> list[Callable]:
    """wids's ``transformations=`` as a list of functions; None means ``"PIL"``.

    >>> interpret_transformations(None)
    [WidsDecoder('pil')]
    >>> interpret_transformations([])
    []
    """
    if transformations is None:
        transformations = "PIL"
    if isinstance(transformations, str) or callable(transformations):
        transformations = [transformations]
    out: list[Callable] = []
    for t in transformations:
        if isinstance(t, str):
            out.append(WidsDecoder(t))  # type: ignore[arg-type]
        elif callable(t):
            out.append(t)
        else:
            raise TypeError(
                f"transformations= takes 'PIL', 'numpy', functions of the sample dict, or a "
                f"list of those, got {t!r}"
            )
    return out
