"""Decoding a sample: from the raw fields of a shard (bytes by extension) to what
``ShardListDataset[i]`` returns.

:class:`SampleDecoder` does it one of two ways, chosen once from the dataset's arguments:

* wids's (``transformations=``, the default): the fields as ``io.BytesIO`` under wids's
  keys (``.jpg``), through :class:`WidsDecoder` (``"PIL"``, ``"numpy"``) and the user's
  functions, as ``wids.ShardListDataset`` does, so that code written for wids gets the
  same samples;
* this package's (``decode=``/``keys=``): each field by its extension with
  :data:`DEFAULT_DECODERS` (or the user's table or function), then a tuple of ``keys``.

``transform=`` and ``add_transform()`` come after either. A field that fails to decode
raises :class:`~dask_ddp.data.CorruptDataError` naming the shard, the sample and the field.
The field decoders here are also :class:`~dask_ddp.data.S3ImageFolder`'s
(:func:`decode_image`) and what :func:`~dask_ddp.data.write_shards` encodes for.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from dask_ddp.data._errors import CorruptDataError, MissingFieldError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision's ``IMG_EXTENSIONS`` (the tests check they agree), copied so that the
datasets do not import torchvision (about 1 s in every spawned worker)."""


def decode_image(data: bytes) -> Image.Image:
    """Decode image bytes into an RGB :class:`PIL.Image.Image`, as ImageFolder's loader does.

    Parameters
    ----------
    data : bytes
        The encoded image (JPEG, PNG, ... anything Pillow reads).

    Returns
    -------
    PIL.Image.Image
        The image, fully loaded and converted to RGB.

    Examples
    --------
    >>> buf = io.BytesIO()
    >>> Image.new("L", (4, 3), 128).save(buf, format="PNG")
    >>> img = decode_image(buf.getvalue())
    >>> img.mode, img.size
    ('RGB', (4, 3))
    """
    img = Image.open(io.BytesIO(data))
    return img.convert("RGB")


# -- fields by extension ------------------------------------------------------------------

IMAGE_EXTS = frozenset(e.lstrip(".") for e in IMG_EXTENSIONS)
INT_EXTS = frozenset({"cls", "cls2", "index", "inx", "id"})
TEXT_EXTS = frozenset({"txt", "text", "transcript"})
JSON_EXTS = frozenset({"json", "jsn"})


def _decode_int(data: bytes) -> int:
    return int(data.decode("ascii").strip())


def _decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def _decode_json(data: bytes) -> Any:
    return json.loads(data)


def _decode_pth(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _decode_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


DEFAULT_DECODERS: dict[str, Callable[[bytes], Any]] = {
    **dict.fromkeys(sorted(IMAGE_EXTS), decode_image),
    **dict.fromkeys(sorted(INT_EXTS), _decode_int),
    **dict.fromkeys(sorted(TEXT_EXTS), _decode_text),
    **dict.fromkeys(sorted(JSON_EXTS), _decode_json),
    "pth": _decode_pth,
    "npy": _decode_npy,
}
"""How :class:`ShardListDataset` decodes a field by default, keyed by the last part of its
extension (``seg.png`` decodes as ``png``): images to RGB :class:`PIL.Image.Image`,
``cls``/``index``/``id`` to int, ``txt`` to str, ``json`` to Python objects, ``pth`` with
``torch.load(weights_only=True)``, ``npy`` with ``numpy.load(allow_pickle=False)``. Other
fields stay bytes (pickles are never unpickled)."""


class Sample(dict):
    """A sample's dict; looking up a field it lacks raises :class:`MissingFieldError`
    (a ``KeyError``) naming the shard, the sample and the fields it has.

    >>> sample = Sample({".jpg": b"", "__key__": "000017", "__shard__": "s.tar"})
    >>> try:
    ...     sample[".png"]
    ... except KeyError as err:
    ...     print(err)  # doctest: +ELLIPSIS
    sample '000017' in s.tar has no '.png' field (it has: .jpg). ...
    """

    def __missing__(self, key: Any) -> Any:
        if not isinstance(key, str) or key.startswith("__"):
            raise KeyError(key)
        available = tuple(k for k in self if not k.startswith("__"))
        raise MissingFieldError(
            str(self.get("__shard__")), str(self.get("__key__")), key, available
        )


def _fields(raw: Mapping[str, Any], streams: bool) -> Sample:
    """A raw sample (``ext: bytes``) under wids's keys (``.ext``), the bytes as they are or,
    as wids gives them to its transformations (``streams``), in ``io.BytesIO``."""
    return Sample(
        (k, v) if k.startswith("__") else ("." + k, io.BytesIO(v) if streams else v)
        for k, v in raw.items()
    )


# -- wids's way: transformations ----------------------------------------------------------

Transformations = str | Callable[[Any], Any] | Iterable[str | Callable[[Any], Any]]
"""What ``ShardListDataset(transformations=...)`` takes, as wids does."""

_WIDS_IMAGES = frozenset({"jpg", "png", "ppm", "pgm", "pbm", "pnm"})


def _decode_safetensors(data: bytes) -> Any:
    import safetensors.torch

    return safetensors.torch.load(data)


def _decode_msgpack(data: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(data, raw=False)


_WIDS_BASIC: dict[str, Callable[[bytes], Any]] = {
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

    It follows wids 0.1.11: ``.gz`` fields are decompressed (the key keeps its ``.gz``),
    ``txt``/``text`` become str, ``cls``/``cls2`` int, ``json`` Python objects, ``npy``
    arrays, ``pth``/``pt`` tensors, ``safetensors`` and ``mp`` (msgpack) their objects, and
    ``jpg``/``png``/``ppm``/``pgm``/``pbm``/``pnm`` images a ``PIL.Image`` as opened
    (``"PIL"``) or a numpy array of it (``"numpy"``). Two differences, both for safety:
    ``npy`` and ``pth`` load without pickles (``allow_pickle=False``,
    ``weights_only=True``), and ``pkl``/``pickle`` fields stay ``io.BytesIO`` instead of
    being unpickled (``pickle.load(sample[".pkl"])`` in your own transformation does what
    wids did).

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
        if ext in _WIDS_BASIC:
            return _WIDS_BASIC[ext](bytes(data))
        if ext in _WIDS_IMAGES:
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


# -- the sample decoder -------------------------------------------------------------------

Decode = bool | Mapping[str, Callable[[bytes], Any] | None] | Callable[..., Any]
"""What ``ShardListDataset(decode=...)`` takes."""


class SampleDecoder:
    """Turn a raw sample (a dict of bytes by extension, plus ``__key__``, ``__shard__``,
    ``__index__``, ``__shardindex__``, ``__dataset__``) into what ``ds[i]`` returns.

    Without ``decode`` and ``keys``: wids's way, the dict through ``transformations``
    (default ``"PIL"``), then ``transform``, then each :meth:`add_transform`. With either:
    decode each field (``decode``, default True: :data:`DEFAULT_DECODERS`), pick ``keys``
    as a tuple, then ``transform``, then each :meth:`add_transform`. Either way the sample
    dict has wids's keys (``.jpg``, ``.cls``). Pickles when the functions given do.

    Parameters are :class:`~dask_ddp.data.ShardListDataset`'s of the same names.

    Raises
    ------
    TypeError, ValueError
        The arguments mix the two ways or are malformed.

    Examples
    --------
    >>> raw = {"cls": b"3", "txt": b"three", "__key__": "000003", "__shard__": "s.tar"}
    >>> SampleDecoder(keys=("txt", "cls"))(raw)
    ('three', 3)
    >>> SampleDecoder(transformations=[])(raw)[".cls"].getvalue()
    b'3'
    """

    def __init__(
        self,
        decode: Decode | None = None,
        keys: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | Sequence[Callable[[Any], Any] | None] | None = None,
        transformations: Transformations | None = None,
    ) -> None:
        ours = decode is not None or keys is not None
        if ours and transformations is not None:
            raise TypeError(
                "transformations= (wids's decoding) and decode=/keys= are two ways to decode "
                "a sample; pass one of them (see docs/data.md, 'Two ways to decode')"
            )
        if decode is not None and not (isinstance(decode, (bool, Mapping)) or callable(decode)):
            raise TypeError(
                f"decode= takes True, False, a mapping {{ext: fn(bytes)}} or a function of "
                f"the raw sample dict, got {decode!r}"
            )
        if isinstance(keys, str):
            raise TypeError(f"keys= takes a sequence of field names, e.g. ({keys!r},)")
        if keys is not None and not keys:
            raise ValueError("keys= is empty; leave it None to get each sample as a dict")
        if (
            transform is not None
            and not callable(transform)
            and (keys is None or isinstance(transform, str) or len(transform) != len(keys))
        ):
            raise TypeError(
                "transform= takes a function, or (with keys=) one function or None per "
                f"key; got {transform!r} for keys={keys!r}"
            )
        #: None: wids's transformations decode; else True, False, a table or a function
        self.decode = (True if decode is None else decode) if ours else None
        self.keys = tuple(keys) if keys is not None else None
        self.transform = transform
        # wids's order: its transformations (decoders first), then transform=, then each
        # add_transform(); with decode=/keys=: decode, pick keys, transform=, add_transform()
        self.transformations = [] if ours else interpret_transformations(transformations)
        if not ours and transform is not None:
            self.transformations.append(transform)

    def add_transform(self, transform: Callable[[Any], Any]) -> None:
        """Apply ``transform`` to every sample after what is already applied."""
        if not callable(transform):
            raise TypeError(f"add_transform() takes a function of the sample, got {transform!r}")
        self.transformations.append(transform)

    def __call__(self, raw: dict[str, Any]) -> Any:
        """The sample ``ds[i]`` returns for ``raw``; :class:`CorruptDataError` if a field
        does not decode, :class:`MissingFieldError` if one of ``keys`` is missing."""
        return self._finish(self._decode(raw), raw)

    def _decode(self, raw: dict[str, Any]) -> Any:
        decode = self.decode
        fields = _fields(raw, streams=decode is None)
        if decode is None or decode is False:  # wids's decoders run among the transformations
            return fields
        if callable(decode) and not isinstance(decode, (bool, Mapping)):
            try:
                return decode(fields)
            except Exception as err:
                raise CorruptDataError(
                    f"{raw['__shard__']}#{raw['__key__']}", f"{type(err).__name__}: {err}"
                ) from err
        table: Mapping[str, Callable[[bytes], Any] | None] = DEFAULT_DECODERS
        if isinstance(decode, Mapping):
            table = {**DEFAULT_DECODERS, **{k.lower().lstrip("."): v for k, v in decode.items()}}
        for ext, value in raw.items():
            fn = table.get(ext.rsplit(".", 1)[-1]) if not ext.startswith("__") else None
            if fn is None:
                continue
            try:
                fields["." + ext] = fn(value)
            except Exception as err:
                raise CorruptDataError(
                    f"{raw['__shard__']}#{raw['__key__']}.{ext}", f"{type(err).__name__}: {err}"
                ) from err
        return fields

    def _finish(self, sample: Any, raw: Mapping[str, Any]) -> Any:
        if self.keys is not None:
            if not isinstance(sample, Mapping):
                raise TypeError(
                    f"keys= picks fields from a dict, but decode= returned a "
                    f"{type(sample).__name__}; return a dict from decode=, or drop keys="
                )
            sample = tuple(_field(sample, k, raw) for k in self.keys)
            if self.transform is not None and not callable(self.transform):
                sample = tuple(
                    v if t is None else t(v) for v, t in zip(sample, self.transform, strict=True)
                )
        if callable(self.transform) and self.decode is not None:
            sample = self.transform(sample)
        for transform in self.transformations:
            sample = transform(sample)
        return sample


def _field(sample: Mapping[str, Any], wanted: str, raw: Mapping[str, Any]) -> Any:
    """The first of the ``;``-separated fields in ``wanted`` that the sample has."""
    for name in wanted.split(";"):
        key = name if name.startswith("__") else "." + name.lstrip(".")
        if key in sample:  # "jpg" or ".jpg"; "__key__" as it is
            return sample[key]
    available = tuple(k for k in sample if not k.startswith("__"))
    raise MissingFieldError(raw["__shard__"], raw["__key__"], wanted, available)
