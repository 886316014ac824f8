"""Fixtures for the dataset tests: a test image tree, uploaded to the real S3 server of
tests/conftest.py (``s3_endpoint``, ``s3_client``, ``bucket``; its ``flaky_proxy`` fails
some requests on purpose)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def _upload_tree(client, bucket: str, prefix: str, root: Path) -> list[str]:
    """Upload every file under ``root`` to ``s3://bucket/prefix/<relative path>``."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    keys = [f"{prefix}/{p.relative_to(root).as_posix()}".lstrip("/") for p in files]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p, k: client.upload_file(str(p), bucket, k), files, keys))
    return keys


def _write_image(path: Path, seed: int, size: tuple[int, int] = (12, 10)) -> None:
    """A small random image; the format follows the suffix (.jpg, .png, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".bmp": "BMP"}[path.suffix.lower()]
    Image.fromarray(pixels).save(path, format=fmt)


# Test modules take these helpers as fixtures rather than importing them: another
# conftest.py may be the module named "conftest" when they are collected.
@pytest.fixture
def write_image() -> Callable[..., None]:
    """``write_image(path, seed, size=(12, 10))`` writes a small random image."""
    return _write_image


@pytest.fixture
def upload_tree(s3_client) -> Callable[[str, str, Path], list[str]]:
    """``upload_tree(bucket, prefix, root)`` uploads a local tree; returns the keys."""
    return functools.partial(_upload_tree, s3_client)


IMAGE_TREE = [
    "cat/0.jpg",
    "cat/1.JPEG",
    "cat/a.b/2.png",
    "cat/a/3.jpg",
    "cat/a/x/4.png",
    "dog/10.png",
    "dog/9.jpg",
    "dog/b[1]/5.jpg",
    "zebra/z.bmp",
    "zebra/y.jpeg",
    "zebra/w.jpg",
    "zebra/v.png",
]
NOT_IMAGES = ["cat/notes.txt", "README.md", "zebra/labels.csv"]


@pytest.fixture
def image_count() -> int:
    """How many images ``image_tree`` holds."""
    return len(IMAGE_TREE)


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    """An ImageFolder tree on local disk: 3 classes, nested folders, mixed formats,
    a key with glob characters, and files that are not images."""
    root = tmp_path / "images"
    for seed, rel in enumerate(IMAGE_TREE):
        _write_image(root / rel, seed)
    for rel in NOT_IMAGES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("not an image")
    return root


@pytest.fixture
def s3_images(s3_client, bucket: str, image_tree: Path) -> tuple[str, str, Path]:
    """``(bucket, prefix, local_root)``: ``image_tree`` uploaded under ``data/train``."""
    _upload_tree(s3_client, bucket, "data/train", image_tree)
    return bucket, "data/train", image_tree
