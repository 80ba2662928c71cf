"""The ``tensorflow_datasets`` path: file-based datasets not found locally are loaded through TFDS when it is
installed (``pip install sidejax[tfds]``; ``download=True`` lets TFDS fetch them)."""

from __future__ import annotations

import numpy as np

from sidejax.data.base import Dataset, images_to_float
from sidejax.data.idx import IDX_DATASETS, mnist_like

__all__ = ["tfds_installed", "tfds_name", "load_tfds"]


def tfds_installed() -> bool:
    """Whether ``tensorflow_datasets`` can be imported."""
    try:
        import tensorflow_datasets  # noqa: F401
    except ImportError:
        return False
    return True


def tfds_name(name: str, subset: str) -> str:
    """The TFDS name of a dataset (``emnist/<subset>`` for EMNIST)."""
    return f"emnist/{subset}" if name == "emnist" else name


def load_tfds(name: str, split: str, subset: str, download: bool) -> Dataset:
    """One split of ``name`` through ``tensorflow_datasets.load``, in the common format."""
    import tensorflow_datasets as tfds

    ds = tfds.load(tfds_name(name, subset), split=split, batch_size=-1, download=download, as_supervised=True)
    images, labels = tfds.as_numpy(ds)
    if name in IDX_DATASETS:
        return mnist_like(name, subset, images, labels)
    x = images_to_float(images)
    return Dataset(x, np.asarray(labels).astype(np.int32), 10 if name == "cifar10" else 100)
