"""MNIST from its IDX files through `datasets`, and the batch collator of the ViT recipes.

The IDX files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-...``) may be raw, ``.gz`` or
``.xz`` (the shared copy has the train images as ``.xz``, the others as the official ``.gz``).  IDX format: a
big-endian int32 magic (0x00000803 for images, 0x00000801 for labels), one int32 per dimension, then the raw
uint8 values in row-major order.
"""

from __future__ import annotations

import gzip
import lzma
import os
import struct

import numpy as np


SPLIT_PREFIX = {"train": "train", "test": "t10k"}
IMAGE_MAGIC, LABEL_MAGIC = 0x00000803, 0x00000801


def _open(path):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    return open(path, "rb")


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (raw, .gz or .xz) of unsigned bytes into a uint8 array of its stated shape."""
    with _open(path) as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: not an IDX file (too short)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(data) - offset != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but {len(data) - offset} bytes follow")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


def write_idx(path: str, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (``.gz`` compressed when the path ends in .gz); used by the tests."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with (gzip.open(path, "wb") if path.endswith(".gz") else open(path, "wb")) as f:
        f.write(header + array.tobytes())


def split_files(data_dir: str, split: str) -> tuple[str, str]:
    """Paths of the images and labels IDX files of ``split`` ("train" or "test") in ``data_dir``."""
    if split not in SPLIT_PREFIX:
        raise ValueError(f"split must be one of {sorted(SPLIT_PREFIX)}; got {split!r}")
    found = []
    for kind, ndim in (("images", 3), ("labels", 1)):
        base = os.path.join(data_dir, f"{SPLIT_PREFIX[split]}-{kind}-idx{ndim}-ubyte")
        paths = [base + ext for ext in ("", ".gz", ".xz") if os.path.exists(base + ext)]
        if not paths:
            raise FileNotFoundError(f"no {base}[.gz|.xz] (MNIST IDX files expected in {data_dir})")
        found.append(paths[0])
    return found[0], found[1]


def _mnist_examples(images_path: str, labels_path: str, max_samples: int | None):
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(f"IDX shapes do not match: images {images.shape}, labels {labels.shape}")
    n = images.shape[0] if max_samples is None else min(max_samples, images.shape[0])
    for i in range(n):
        yield {"image": images[i], "label": int(labels[i])}


def load_mnist(data_dir: str, split: str, max_samples: int | None = None, cache_dir: str | None = None):
    """MNIST ``split`` as a ``datasets.Dataset`` with columns ``image`` (uint8 [28, 28]) and ``label`` (0-9).

    ``max_samples`` keeps the first N examples (the files' order).  ``cache_dir``: where `datasets` writes its
    Arrow cache (default: the `datasets` cache, ``$HF_HOME/datasets``).
    """
    import datasets

    images_path, labels_path = split_files(data_dir, split)
    rows, cols = read_idx(images_path).shape[1:]
    features = datasets.Features(
        {
            "image": datasets.Array2D(shape=(rows, cols), dtype="uint8"),
            "label": datasets.ClassLabel(names=[str(i) for i in range(10)]),
        }
    )
    ds = datasets.Dataset.from_generator(
        _mnist_examples,
        features=features,
        gen_kwargs={"images_path": os.path.abspath(images_path), "labels_path": os.path.abspath(labels_path),
                    "max_samples": max_samples},
        cache_dir=cache_dir,
        split=datasets.Split.TRAIN if split == "train" else datasets.Split.TEST,
    )
    return ds.with_format("numpy")


def random_shift(images: np.ndarray, max_shift: int, rng: np.random.Generator) -> np.ndarray:
    """Translate each image ``[B, H, W]`` by up to ``max_shift`` pixels in each direction (zero fill)."""
    if max_shift <= 0:
        return images
    b, h, w = images.shape
    padded = np.pad(images, ((0, 0), (max_shift, max_shift), (max_shift, max_shift)))
    dy = rng.integers(0, 2 * max_shift + 1, size=b)
    dx = rng.integers(0, 2 * max_shift + 1, size=b)
    return np.stack([padded[i, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])


class MnistCollator:
    """List of ``{"image", "label"}`` examples -> ``{"pixel_values", "labels"}`` through the image processor.

    ``max_shift > 0`` applies the light augmentation (random translation); use 0 for evaluation.  The DeiT
    augmentations (see :mod:`vit_deit`) plug in at their places in the pipeline:

    * ``image_transform``: per image, on the PIL image after the shift (RandAugment);
    * ``pixel_transform``: on the normalised ``pixel_values`` batch ``[B, C, H, W]`` (random erasing);
    * ``batch_transform``: ``(pixel_values, labels) -> (pixel_values, labels)`` last (Mixup / CutMix, which turns
      the labels into soft targets ``[B, num_classes]``).
    """

    def __init__(
        self,
        image_processor,
        max_shift: int = 0,
        seed: int = 0,
        image_transform=None,
        pixel_transform=None,
        batch_transform=None,
    ):
        self.image_processor = image_processor
        self.max_shift = max_shift
        self.seed = seed
        self.image_transform = image_transform
        self.pixel_transform = pixel_transform
        self.batch_transform = batch_transform
        self._rngs = {}

    def _rng(self) -> np.random.Generator:
        # one generator per DataLoader worker, seeded from torch's per-worker seed, so workers draw different shifts
        import torch

        info = torch.utils.data.get_worker_info()
        key = None if info is None else (info.id, info.seed)
        if key not in self._rngs:
            self._rngs[key] = np.random.default_rng(self.seed if info is None else info.seed)
        return self._rngs[key]

    def __call__(self, examples):
        import torch

        images = np.stack([np.asarray(e["image"], dtype=np.uint8) for e in examples])
        images = random_shift(images, self.max_shift, self._rng())
        if self.image_transform is not None:
            from PIL import Image

            images = np.stack([np.asarray(self.image_transform(Image.fromarray(img)), dtype=np.uint8) for img in images])
        # a list of 2-D images is unambiguous (a [3, 28, 28] array could be read as one 3-channel image)
        pixel_values = self.image_processor(list(images), return_tensors="pt")["pixel_values"]
        labels = torch.tensor([int(e["label"]) for e in examples], dtype=torch.long)
        if self.pixel_transform is not None:
            pixel_values = self.pixel_transform(pixel_values)
        if self.batch_transform is not None:
            pixel_values, labels = self.batch_transform(pixel_values, labels)
        return {"pixel_values": pixel_values, "labels": labels}
