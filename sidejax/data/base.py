"""The common format of every dataset loader, and the argument checks they share.

Every loader returns a :class:`Dataset` ``(x, y, num_classes)``:

* images are NHWC ``float32`` in ``[0, 1]`` (:func:`images_to_float`), labels are ``int32`` in
  ``[0, num_classes)``;
* tabular inputs are ``float32`` ``[N, D]``;
* regression targets are ``float32`` with ``num_classes == 0``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "SPLITS",
    "Dataset",
    "check_split",
    "check_positive_int",
    "check_nonneg_float",
    "check_seed",
    "images_to_float",
]

#: The splits every dataset has.
SPLITS: tuple[str, ...] = ("train", "test")


class Dataset(NamedTuple):
    """A dataset split held as host numpy arrays.

    Attributes:
        x: Inputs, ``float32``; images are NHWC in ``[0, 1]``.
        y: Targets: ``int32`` class labels in ``[0, num_classes)``, or ``float32`` regression targets.
        num_classes: Number of classes, ``0`` for regression.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int


def check_split(split: str) -> None:
    """Raises ``ValueError`` unless ``split`` is one of :data:`SPLITS`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}.")


def check_positive_int(value: Any, arg: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 1 (not a bool), else ``ValueError`` naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{arg} must be a positive integer; got {value!r}.")
    return int(value)


def check_nonneg_float(value: Any, arg: str) -> float:
    """``value`` as a ``float`` if it is a number >= 0 (not a bool), else ``ValueError`` naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.number) or not value >= 0:
        raise ValueError(f"{arg} must be a non-negative number; got {value!r}.")
    return float(value)


def check_seed(value: Any) -> int:
    """``value`` as an ``int`` if it is an integer >= 0 (not a bool), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"seed must be a non-negative integer; got {value!r}.")
    return int(value)


def images_to_float(images: np.ndarray) -> np.ndarray:
    """uint8 ``[N, H, W]`` or ``[N, H, W, C]`` -> float32 NHWC in ``[0, 1]`` (divided by 255)."""
    x = np.asarray(images)
    if x.ndim == 3:
        x = x[..., None]
    return x.astype(np.float32) / np.float32(255.0)
