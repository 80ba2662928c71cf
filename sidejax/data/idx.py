"""The MNIST family's files: the IDX format (:func:`read_idx`), the file names of MNIST, Fashion-MNIST and
EMNIST, and their conversion to the common :class:`sidejax.data.base.Dataset` format (EMNIST's transposed
images and 1-based letter labels included)."""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from sidejax.data.base import Dataset, images_to_float

__all__ = [
    "IDX_DATASETS",
    "EMNIST_SUBSETS",
    "IDX_DTYPES",
    "read_idx",
    "idx_file_names",
    "load_idx_pair",
    "mnist_like",
]

#: The datasets stored as IDX files.
IDX_DATASETS: tuple[str, ...] = ("mnist", "fashion_mnist", "emnist")

#: EMNIST subsets and their number of classes.
EMNIST_SUBSETS: dict[str, int] = {
    "byclass": 62,
    "bymerge": 47,
    "balanced": 47,
    "letters": 26,
    "digits": 10,
    "mnist": 10,
}

#: IDX type codes -> big-endian numpy dtypes.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX file (the MNIST file format), optionally gzip-compressed.

    The format is a 4-byte magic number ``0x00 0x00 <type code> <ndim>``, ``ndim`` big-endian ``uint32``
    dimension sizes, then the big-endian data in C order. A file whose name ends in ``.gz`` is
    decompressed first.

    Args:
        path: Path of the ``.gz`` or plain IDX file.

    Returns:
        The array, with the shape given by the header, in native byte order (a fresh writable copy).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is corrupt: bad magic number, unknown type code, truncated header,
            a data size that does not match the header, or an invalid gzip stream. The message names
            the file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"IDX file {path!r} does not exist.")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"IDX file {path!r} is not a valid gzip stream (corrupt or truncated): {e}") from e

    if len(raw) < 4:
        raise ValueError(f"IDX file {path!r} is truncated: {len(raw)} bytes, shorter than the 4-byte magic.")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(
            f"IDX file {path!r} has a bad magic number {raw[:4].hex()}: the first two bytes must be zero."
        )
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        valid = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise ValueError(f"IDX file {path!r} has unknown data type code 0x{code:02X}; valid codes: {valid}.")
    if ndim == 0:
        raise ValueError(f"IDX file {path!r} declares 0 dimensions; at least one is required.")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(
            f"IDX file {path!r} is truncated: header needs {header} bytes for {ndim} dimensions, file has "
            f"{len(raw)}."
        )
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) - header
    if actual != expected:
        what = "truncated" if actual < expected else "has trailing bytes"
        raise ValueError(
            f"IDX file {path!r} {what}: header shape {shape} of {dtype.itemsize}-byte items needs "
            f"{expected} data bytes, found {actual}."
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def idx_file_names(name: str, split: str, subset: str) -> tuple[str, str]:
    """Base file names (without ``.gz``) of the images and labels of an IDX dataset split (``subset``: the
    EMNIST subset, ignored for MNIST and Fashion-MNIST)."""
    if name == "emnist":
        return (
            f"emnist-{subset}-{split}-images-idx3-ubyte",
            f"emnist-{subset}-{split}-labels-idx1-ubyte",
        )
    prefix = "train" if split == "train" else "t10k"
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def load_idx_pair(img_path: str, lbl_path: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads an image file ``[N, H, W]`` and its label file ``[N]``; ``ValueError`` naming the files if the
    shapes do not fit."""
    images = read_idx(img_path)
    labels = read_idx(lbl_path)
    if images.ndim != 3:
        raise ValueError(f"IDX image file {img_path!r} must be 3-D [N, H, W]; got shape {images.shape}.")
    if labels.ndim != 1:
        raise ValueError(f"IDX label file {lbl_path!r} must be 1-D [N]; got shape {labels.shape}.")
    if len(images) != len(labels):
        raise ValueError(
            f"IDX files {img_path!r} and {lbl_path!r} disagree on the number of examples: "
            f"{len(images)} images vs {len(labels)} labels."
        )
    return images, labels


def mnist_like(name: str, subset: str, images: np.ndarray, labels: np.ndarray) -> Dataset:
    """MNIST-family arrays (from IDX files or TFDS) in the common format: ``[N, 28, 28, 1]`` in ``[0, 1]``,
    ``int32`` labels. EMNIST images are stored transposed and are transposed back; EMNIST letters are
    labelled 1..26 and are shifted to 0..25."""
    images = np.asarray(images)
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    labels = np.asarray(labels).astype(np.int64).reshape(-1)
    num_classes = 10
    if name == "emnist":
        # EMNIST images are stored transposed (flipped and rotated); transpose H and W back.
        images = images.transpose(0, 2, 1)
        num_classes = EMNIST_SUBSETS[subset]
        if subset == "letters":
            labels = labels - 1  # letters are labelled 1..26
    return Dataset(images_to_float(images), labels.astype(np.int32), num_classes)
