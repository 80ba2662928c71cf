"""CIFAR-10 and CIFAR-100 from their python pickle batches (``cifar-10-batches-py``, ``cifar-100-python``),
in the common :class:`sidejax.data.base.Dataset` format (``[N, 32, 32, 3]`` in ``[0, 1]``)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import numpy as np

from sidejax.data.base import Dataset, images_to_float

__all__ = ["CIFAR_FOLDERS", "cifar_file_names", "load_cifar_files"]

#: The folder each CIFAR archive extracts to.
CIFAR_FOLDERS: dict[str, str] = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def cifar_file_names(name: str, split: str) -> list[str]:
    """The batch files of a split, inside :data:`CIFAR_FOLDERS` ``[name]``."""
    if name == "cifar10":
        return [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return [split]


def _unpickle(path: str) -> dict:
    # The CIFAR python batches are pickles; only load files you trust.
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise ValueError(f"CIFAR batch file {path!r} is corrupt or truncated: {e}") from e
    if not isinstance(batch, dict):
        raise ValueError(f"CIFAR batch file {path!r} must hold a dict; got {type(batch).__name__}.")
    return batch


def load_cifar_files(name: str, paths: Sequence[str]) -> Dataset:
    """Reads and concatenates the batch files ``paths`` of ``"cifar10"`` (labels ``b"labels"``) or
    ``"cifar100"`` (fine labels); ``ValueError`` naming the file if one is corrupt or malformed."""
    label_key = b"labels" if name == "cifar10" else b"fine_labels"
    xs, ys = [], []
    for path in paths:
        batch = _unpickle(path)
        if b"data" not in batch or label_key not in batch:
            raise ValueError(
                f"CIFAR batch file {path!r} lacks the keys b'data' and {label_key!r}; found {sorted(batch)}."
            )
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[label_key], dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
            raise ValueError(
                f"CIFAR batch file {path!r} has data of shape {data.shape} and {len(labels)} labels; "
                "expected [N, 3072] with N labels."
            )
        xs.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(labels)
    x = images_to_float(np.concatenate(xs))
    return Dataset(x, np.concatenate(ys).astype(np.int32), 10 if name == "cifar10" else 100)
