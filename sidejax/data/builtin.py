"""Datasets that need no files: scikit-learn's bundled ``digits``, the generated ``moons``, and the synthetic
linear and logistic regressions (:func:`synthetic_regression`)."""

from __future__ import annotations

import numpy as np

from sidejax.data.base import (
    SPLITS,
    Dataset,
    check_nonneg_float,
    check_positive_int,
    check_seed,
    check_split,
)

__all__ = ["synthetic_regression", "load_digits", "load_moons"]


def synthetic_regression(
    num_samples: int,
    dim: int,
    *,
    kind: str = "linear",
    noise: float = 0.1,
    seed: int = 0,
    split: str = "train",
) -> Dataset:
    """Draws a synthetic linear- or logistic-regression dataset.

    The true weights ``w ~ N(0, I / dim)`` depend only on ``seed``, so the train and test splits of the
    same seed share them; the inputs ``x ~ N(0, I)`` are drawn from a separate random stream per split,
    so the splits are independent samples.

    Args:
        num_samples: Number of examples ``N`` (positive).
        dim: Input dimension ``D`` (positive).
        kind: ``"linear"`` (``y = x @ w + noise * eps``, ``float32``, ``num_classes = 0``) or
            ``"logistic"`` (``y ~ Bernoulli(sigmoid(x @ w))``, ``int32``, ``num_classes = 2``).
        noise: Standard deviation of the additive Gaussian noise of the linear model (non-negative;
            unused for ``"logistic"``).
        seed: Non-negative integer seed.
        split: ``"train"`` or ``"test"``; selects the input stream.

    Returns:
        A :class:`Dataset` with ``x`` ``float32 [N, D]``.

    Raises:
        ValueError: If an argument is out of range.
    """
    num_samples = check_positive_int(num_samples, "num_samples")
    dim = check_positive_int(dim, "dim")
    if kind not in ("linear", "logistic"):
        raise ValueError(f"kind must be one of linear, logistic; got {kind!r}.")
    noise = check_nonneg_float(noise, "noise")
    seed = check_seed(seed)
    check_split(split)

    w = np.random.default_rng(seed).normal(0.0, 1.0 / np.sqrt(dim), size=dim)
    rng = np.random.default_rng([seed, SPLITS.index(split) + 1])
    x = rng.standard_normal((num_samples, dim))
    logits = x @ w
    if kind == "linear":
        y = (logits + noise * rng.standard_normal(num_samples)).astype(np.float32)
        return Dataset(x.astype(np.float32), y, 0)
    p = 1.0 / (1.0 + np.exp(-logits))
    y = (rng.random(num_samples) < p).astype(np.int32)
    return Dataset(x.astype(np.float32), y, 2)


def load_digits(split: str) -> Dataset:
    """scikit-learn's 1797 8x8 digits, ``[N, 8, 8, 1]`` in ``[0, 1]``, with a fixed 80/20 split (seed 0):
    1437 train and 360 test images."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = (np.asarray(bunch.images, dtype=np.float32) / 16.0)[..., None]
    y = np.asarray(bunch.target, dtype=np.int32)
    perm = np.random.default_rng(0).permutation(len(y))
    num_train = int(0.8 * len(y))
    idx = perm[:num_train] if split == "train" else perm[num_train:]
    return Dataset(x[idx], y[idx], 10)


def load_moons(split: str, num_samples: int, noise: float, seed: int) -> Dataset:
    """scikit-learn's two moons, ``float32 [N, 2]``; the test split is drawn with ``seed + 1``."""
    from sklearn.datasets import make_moons

    num_samples = check_positive_int(num_samples, "num_samples")
    noise = check_nonneg_float(noise, "noise")
    seed = check_seed(seed)
    random_state = seed if split == "train" else seed + 1
    x, y = make_moons(n_samples=num_samples, noise=noise, random_state=random_state)
    return Dataset(x.astype(np.float32), y.astype(np.int32), 2)
