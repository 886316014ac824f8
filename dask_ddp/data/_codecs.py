"""How shard samples are decoded and encoded: the default decoders by field extension,
the dataset's decoding of a raw sample (:class:`_SampleDecoding`), and the encoders
:func:`dask_ddp.data.write_shards` uses.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from dask_ddp.data._errors import (
    CorruptDataError,
    MissingFieldError,
)
from dask_ddp.data._imagefolder import IMG_EXTENSIONS, decode_image

logger = logging.getLogger("dask_ddp.data.shards")


_IMAGE_EXTS = frozenset(e.lstrip(".") for e in IMG_EXTENSIONS)
_INT_EXTS = frozenset({"cls", "cls2", "index", "inx", "id"})
_TEXT_EXTS = frozenset({"txt", "text", "transcript"})
_JSON_EXTS = frozenset({"json", "jsn"})


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
    **dict.fromkeys(sorted(_IMAGE_EXTS), decode_image),
    **dict.fromkeys(sorted(_INT_EXTS), _decode_int),
    **dict.fromkeys(sorted(_TEXT_EXTS), _decode_text),
    **dict.fromkeys(sorted(_JSON_EXTS), _decode_json),
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


Decode = bool | Mapping[str, Callable[[bytes], Any] | None] | Callable[..., Any]
"""What ``ShardListDataset(decode=...)`` takes."""


class _SampleDecoding:
    """The part of :class:`~dask_ddp.data.ShardListDataset` that turns a raw sample (a
    dict of bytes by extension) into what ``ds[i]`` returns: wids's ``transformations=``,
    or this package's ``decode=``/``keys=``; then ``transform=`` and :meth:`add_transform`.

    Either way the sample dict has wids's keys: ``.jpg``, ``.cls``, ... and ``__key__``,
    ``__shard__``, ``__index__``, ``__shardindex__``, ``__dataset__``.
    """

    decode: Any  # None: wids's transformations decode
    keys: tuple[str, ...] | None
    transform: Any
    transformations: list[Callable[[Any], Any]]

    def _init_decoding(self, decode: Any, keys: Any, transform: Any, transformations: Any) -> None:
        from dask_ddp.data._wids import interpret_transformations

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
        self.decode = (True if decode is None else decode) if ours else None
        self.keys = tuple(keys) if keys is not None else None
        self.transform = transform
        # wids's order: its transformations (decoders first), then transform=, then each
        # add_transform(); with decode=/keys=: decode, pick keys, transform=, add_transform()
        self.transformations = [] if ours else interpret_transformations(transformations)
        if not ours and transform is not None:
            self.transformations.append(transform)

    def add_transform(self, transform: Callable[[Any], Any]) -> Any:
        """Apply ``transform`` to every sample after what is already applied, as wids's
        ``add_transform``; returns the dataset.

        Examples
        --------
        >>> ds = ShardListDataset("shards.json").add_transform(
        ...     lambda s: (s[".jpg"], s[".cls"]))  # doctest: +SKIP
        """
        if not callable(transform):
            raise TypeError(f"add_transform() takes a function of the sample, got {transform!r}")
        self.transformations.append(transform)
        return self

    def _decode(self, raw: dict[str, Any]) -> Any:
        decode = self.decode
        fields = _fields(raw, streams=decode is None)
        if decode is None:  # wids: the decoders among the transformations run in _finish
            return fields
        if decode is False:
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
            sample = tuple(self._field(sample, k, raw) for k in self.keys)
            if self.transform is not None and not callable(self.transform):
                sample = tuple(
                    v if t is None else t(v) for v, t in zip(sample, self.transform, strict=True)
                )
        if callable(self.transform) and self.decode is not None:
            sample = self.transform(sample)
        for transform in self.transformations:
            sample = transform(sample)
        return sample

    @staticmethod
    def _field(sample: Mapping[str, Any], wanted: str, raw: Mapping[str, Any]) -> Any:
        for name in wanted.split(";"):
            key = name if name.startswith("__") else "." + name.lstrip(".")
            if key in sample:  # "jpg" or ".jpg"; "__key__" as it is
                return sample[key]
        available = tuple(k for k in sample if not k.startswith("__"))
        raise MissingFieldError(raw["__shard__"], raw["__key__"], wanted, available)


def _ext_of(path: str) -> str:
    return path.rsplit("/", 1)[-1].rsplit(".", 1)[-1].lower()


def _encode_sample(
    item: Any, index: int, fields: Sequence[str] | None, image_format: str
) -> tuple[str, list[tuple[str, bytes]]]:
    if isinstance(item, Mapping):
        key = str(item.get("__key__", f"{index:09d}"))
        values = [  # "__shard__", "__index__", ...: a ShardListDataset's metadata
            (str(k).lower().lstrip("."), v) for k, v in item.items() if not str(k).startswith("__")
        ]
    else:
        key = f"{index:09d}"
        elements = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        if fields is not None:
            if len(fields) != len(elements):
                raise ValueError(
                    f"sample {index} has {len(elements)} elements but fields= names "
                    f"{len(fields)}: {tuple(fields)}"
                )
            names = [f.lower().lstrip(".") for f in fields]
        else:
            names = [_ext_for(v, index, image_format) for v in elements]
        values = list(zip(names, elements, strict=True))
    if not key or "." in key or key.startswith("/"):
        raise ValueError(
            f"sample {index}'s key {key!r} cannot name tar members: it must be non-empty, "
            "without '.', and not start with '/'"
        )
    seen: set[str] = set()
    for ext, _ in values:
        if ext in seen or not ext:
            raise ValueError(
                f"sample {index} has {'two ' + repr(ext) if ext else 'an empty'} field "
                "name; name each field with fields= (tuples) or distinct dict keys"
            )
        seen.add(ext)
    if not values:
        raise ValueError(f"sample {index} has no fields")
    return key, [(ext, _encode_value(ext, v, index)) for ext, v in values]


def _ext_for(value: Any, index: int, image_format: str) -> str:
    if isinstance(value, Image.Image):
        return image_format
    if isinstance(value, (int, np.integer)):
        return "cls"
    if isinstance(value, str):
        return "txt"
    if isinstance(value, torch.Tensor):
        return "pth"
    if isinstance(value, np.ndarray):
        return "npy"
    if isinstance(value, (dict, list)):
        return "json"
    raise TypeError(
        f"sample {index} has a {type(value).__name__}, which write_shards cannot name; "
        "pass fields= with an extension for each element (bytes are written as they are)"
    )


def _encode_value(ext: str, value: Any, index: int) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    last = ext.rsplit(".", 1)[-1]
    try:
        if last in _IMAGE_EXTS and isinstance(value, Image.Image):
            return _encode_image(value, last)
        if last in _INT_EXTS:
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, float) or int(value) != value:
                raise TypeError(f"{type(value).__name__} {value!r} is not an integer")
            return str(int(value)).encode("ascii")
        if last in _TEXT_EXTS and isinstance(value, str):
            return value.encode("utf-8")
        if last in _JSON_EXTS:
            return json.dumps(value).encode("utf-8")
        if last == "pth":
            buf = io.BytesIO()
            torch.save(value, buf)
            return buf.getvalue()
        if last == "npy":
            buf = io.BytesIO()
            np.save(buf, np.asarray(value), allow_pickle=False)
            return buf.getvalue()
    except (TypeError, ValueError) as err:
        raise TypeError(f"sample {index}: cannot encode its {ext!r} field: {err}") from err
    raise TypeError(
        f"sample {index}: cannot encode a {type(value).__name__} as {ext!r}; pass bytes, or "
        "use an extension write_shards encodes (an image extension for PIL images, cls, "
        "txt, json, pth, npy)"
    )


def _encode_image(img: Image.Image, ext: str) -> bytes:
    fmt = Image.registered_extensions()["." + ext]
    buf = io.BytesIO()
    if fmt == "JPEG":
        if img.mode not in ("RGB", "L", "CMYK"):
            img = img.convert("RGB")
        img.save(buf, format=fmt, quality=95)
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()
