"""Images in class folders on S3, with torchvision ``ImageFolder`` semantics.

:class:`S3ImageFolder` is :class:`~dask_ddp.data._files.FileDataset` with ImageFolder's
indexing (classes from the folders under the prefix, sorted; images in ImageFolder's
order) and its sample, ``(image, class_index)``; :func:`decode_image`
(:mod:`dask_ddp.data._decode`) is its loader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from dask_ddp.data._decode import IMG_EXTENSIONS, decode_image
from dask_ddp.data._errors import DataNotFoundError, OnCorrupt
from dask_ddp.data._files import Entry, FileDataset


class S3ImageFolder(FileDataset):
    """Images in class folders on S3, with torchvision ``ImageFolder`` semantics.

    Every folder directly under ``s3://bucket/prefix/`` is a class; classes are sorted
    and numbered from 0; every image under a class folder (at any depth, with one of
    torchvision's :data:`IMG_EXTENSIONS`) is a sample, in ImageFolder's order.
    ``dataset[i]`` is ``(transform(image), target_transform(target))`` where ``image`` is
    an RGB :class:`PIL.Image.Image`, exactly as ``ImageFolder`` gives for the same files.

    A drop-in for dask-pytorch-ddp's ``S3ImageFolder``: its positional arguments and its
    keywords ``s3_bucket=`` and ``s3_prefix=`` work unchanged. The prefix names a folder:
    ``"train"`` and ``"train/"`` both mean the keys under ``train/``.

    Parameters
    ----------
    bucket : str
        The bucket name (``"my-bucket"``; an ``s3://`` in front is accepted).
    prefix : str, default ""
        The folder holding the class folders; ``""`` is the top of the bucket.
    transform, target_transform : callable, optional
        Applied to the image and to the class index.
    anon : bool, default False
        Read a public bucket without credentials.
    s3_bucket, s3_prefix : str, optional
        The predecessor's names for ``bucket`` and ``prefix``.
    decode : callable, default :func:`decode_image`
        ``decode(data: bytes) -> image``, the counterpart of ImageFolder's ``loader``.
    is_valid_file : callable, optional
        ``is_valid_file(url) -> bool`` instead of the extension check, as in ImageFolder.
    allow_empty : bool, default False
        As in ImageFolder: if False, a class folder without any image is an error.
    **kwargs
        ``endpoint_url``, ``storage_options``, ``cache_dir``, ``concurrency``,
        ``retries``, ``on_corrupt``, ``freeze_gc``: see :class:`FileDataset`.

    Attributes
    ----------
    classes : list of str
        The class names, sorted.
    class_to_idx : dict of str to int
        Class name -> class index.
    samples : list of (str, int)
        ``(url, class_index)`` per image; ``imgs`` is the same. Read-only: select
        images with :class:`torch.utils.data.Subset`.
    targets : list of int
        The class index of each image.

    Raises
    ------
    DataNotFoundError
        The bucket does not exist, or nothing is under the prefix.
    DataNotFoundError
        Objects exist but there are no class folders, no images, or (unless
        ``allow_empty``) a class folder without images.

    Examples
    --------
    >>> from torchvision import transforms
    >>> augment = transforms.Compose([transforms.RandomResizedCrop(224), transforms.ToTensor()])
    >>> ds = S3ImageFolder(
    ...     "my-bucket", "imagenet/train", transform=augment,
    ...     endpoint_url="http://seaweedfs:8333",  # any S3-compatible store; omit for AWS
    ...     cache_dir="/local-ssd/cache",          # second epoch reads local disk
    ... )  # doctest: +SKIP
    >>> ds.classes[:2], len(ds)  # doctest: +SKIP
    (['n01440764', 'n01443537'], 1281167)
    >>> old = S3ImageFolder(s3_bucket="my-bucket", s3_prefix="imagenet/train")  # doctest: +SKIP
    """

    def __init__(
        self,
        bucket: str | None = None,
        prefix: str | None = None,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        anon: bool = False,
        *,
        s3_bucket: str | None = None,
        s3_prefix: str | None = None,
        decode: Callable[[bytes], Any] = decode_image,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        endpoint_url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        concurrency: int = 32,
        retries: int = 8,
        on_corrupt: OnCorrupt = "raise",
        freeze_gc: bool = True,
    ) -> None:
        bucket = _one_of("bucket", bucket, "s3_bucket", s3_bucket, required=True)
        prefix = _one_of("prefix", prefix, "s3_prefix", s3_prefix, required=False) or ""
        bucket = bucket.removeprefix("s3://").strip("/")
        if not bucket or "/" in bucket:
            raise ValueError(
                f"bucket= takes a bucket name such as 'my-bucket', got {bucket!r}; put the "
                "folder in prefix=, e.g. S3ImageFolder('my-bucket', 'imagenet/train')"
            )
        self.s3_bucket = bucket
        self.s3_prefix = prefix.strip("/")
        self.anon = anon
        self.target_transform = target_transform
        self.allow_empty = allow_empty
        self.extensions = IMG_EXTENSIONS if is_valid_file is None else None
        self.classes: list[str] = []
        self.class_to_idx: dict[str, int] = {}
        self.targets: list[int] = []
        url = f"s3://{bucket}/{self.s3_prefix}" if self.s3_prefix else f"s3://{bucket}"
        super().__init__(
            url,
            decode,
            transform=transform,
            suffixes=None,
            is_valid_file=is_valid_file,
            endpoint_url=endpoint_url,
            anon=anon,
            storage_options=storage_options,
            cache_dir=cache_dir,
            concurrency=concurrency,
            retries=retries,
            on_corrupt=on_corrupt,
            freeze_gc=freeze_gc,
        )

    def _accepts(self, path: str) -> bool:
        if self.is_valid_file is not None:
            return bool(self.is_valid_file(self._url(path)))
        return path.lower().endswith(IMG_EXTENSIONS)

    def _index(self, root: str, entries: list[Entry]) -> None:
        base = root + "/"
        classes: set[str] = set()
        images = []
        for path, size, token in entries:
            rel = path[len(base) :] if path.startswith(base) else ""
            cls, sep, rest = rel.partition("/")
            if not cls or not sep:
                continue  # not inside a class folder
            classes.add(cls)
            if rest and not rest.endswith("/") and self._accepts(path):
                folder, _, name = rest.rpartition("/")
                images.append(((cls, folder, name), path, size, token))
        if not classes:
            raise DataNotFoundError(
                self.root,
                f"{len(entries)} objects are under it but no class folder: S3ImageFolder "
                f"expects keys like {self.root}/<class>/<image>.jpg",
            )
        self.classes = sorted(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        images.sort(key=lambda item: item[0])  # ImageFolder's order: class, folder, name
        for (cls, _, _), path, size, token in images:
            self._add(path, size, token)
            self.targets.append(self.class_to_idx[cls])
        wanted = (
            "is_valid_file= accepted none"
            if self.extensions is None
            else "looked for " + ", ".join(IMG_EXTENSIONS)
        )
        if not images:
            raise DataNotFoundError(
                self.root, f"{len(entries)} objects are under it but no image ({wanted})"
            )
        empty = sorted(classes - {cls for (cls, _, _), *_ in images})
        if empty and not self.allow_empty:
            raise DataNotFoundError(
                self.root,
                f"the class folders {', '.join(empty)} hold no image ({wanted}); delete "
                "them, or pass allow_empty=True to keep them as classes without samples",
            )

    def _finish(self, index: int, obj: Any) -> tuple[Any, Any]:
        target: Any = self.targets[index]
        if self.transform is not None:
            obj = self.transform(obj)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return obj, target

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(url, class_index)`` of every image, in index order (a new list each time).

        Read-only, unlike ImageFolder's attribute: to train on part of the images, wrap
        the dataset in :class:`torch.utils.data.Subset`.
        """
        return list(zip(self.urls, self.targets, strict=True))

    @property
    def imgs(self) -> list[tuple[str, int]]:
        """The same as :attr:`samples`, as in ImageFolder."""
        return self.samples

    @property
    def all_files(self) -> list[str]:
        """The key of every image, as dask-pytorch-ddp's ``all_files`` (bucket-relative)."""
        cut = len(self.s3_bucket) + 1
        return [p[cut:] for p in self._paths]


def _one_of(name: str, value: Any, old_name: str, old_value: Any, *, required: bool) -> Any:
    if value is not None and old_value is not None:
        raise TypeError(f"pass {name}= or {old_name}=, not both")
    value = value if value is not None else old_value
    if value is None and required:
        raise TypeError(f"S3ImageFolder() needs {name}= (or the older {old_name}=)")
    return value
