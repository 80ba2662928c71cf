"""Datasets that need no files: scikit-learn's bundled ``digits``, the generated ``moons``, the synthetic
linear and logistic regressions (:func:`synthetic_regression`) and BPC-FL's 1-D three-interval regression
(:func:`interval_regression`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sidejax.data.base import (
    SPLITS,
    Dataset,
    check_nonneg_float,
    check_positive_int,
    check_seed,
    check_split,
)

__all__ = [
    "synthetic_regression",
    "load_digits",
    "load_moons",
    "INTERVALS",
    "IntervalRegression",
    "interval_target",
    "interval_regression",
    "interval_regression_test",
]


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


#: BPC-FL's synthetic regression (docs/papers/bpcfl.md#s5-1): the three input intervals.
INTERVALS: tuple[tuple[float, float], ...] = ((-0.8, -0.6), (-0.2, 0.0), (0.5, 0.8))


def interval_target(x) -> np.ndarray:
    """The noiseless target ``f(x) = 1.5 sin(0.4 π x) + 1.5 cos(2 π x)`` (any shape; float64 numpy)."""
    x = np.asarray(x, np.float64)
    return 1.5 * np.sin(0.4 * np.pi * x) + 1.5 * np.cos(2.0 * np.pi * x)


class IntervalRegression(NamedTuple):
    """A federation of the three-interval regression.

    Attributes:
      x: float32 ``[M n, 1]`` inputs, client-major (client ``m`` holds rows ``m n .. (m + 1) n - 1``).
      y: float32 ``[M n]`` noisy targets.
      parts: one int64 index array per client (into ``x`` / ``y``), for
        :func:`sidejax.data.make_federated_data`.
      proportions: float64 ``[M, 3]``, each client's interval probabilities (``Dirichlet([1, 1, 1])``).
      interval: int32 ``[M n]``, the interval each point was drawn from.
      noise: the noise std.
    """

    x: np.ndarray
    y: np.ndarray
    parts: list[np.ndarray]
    proportions: np.ndarray
    interval: np.ndarray
    noise: float


def _draw_points(rng: np.random.Generator, probs: np.ndarray, num: int, noise: float):
    which = rng.choice(len(INTERVALS), size=num, p=probs)
    bounds = np.asarray(INTERVALS, np.float64)
    x = rng.uniform(bounds[which, 0], bounds[which, 1])
    y = interval_target(x) + noise * rng.standard_normal(num)
    return x.astype(np.float32)[:, None], y.astype(np.float32), which.astype(np.int32)


def interval_regression(num_clients: int, per_client: int, *, noise: float = 0.3, seed: int = 0):
    """BPC-FL's 1-D synthetic regression (docs/papers/bpcfl.md#s5-1, docs/papers/bpcfl.md#s8-15):
    ``num_clients`` clients of ``per_client`` points each. Client ``m`` draws its interval probabilities
    ``π_m ~ Dirichlet([1, 1, 1])``; each point picks an interval of :data:`INTERVALS` from ``π_m``, ``x``
    uniform inside it, and ``y = f(x) + ε`` with ``f`` = :func:`interval_target` and ``ε ~ N(0, noise²)``
    (``noise`` is the std).

    Everything is a function of ``seed`` (numpy ``default_rng([seed, 0])``; the test set of
    :func:`interval_regression_test` uses another stream).

    Returns:
      An :class:`IntervalRegression`.

    Raises:
      ValueError: naming the argument out of range.
    """
    num_clients = check_positive_int(num_clients, "num_clients")
    per_client = check_positive_int(per_client, "per_client")
    noise = check_nonneg_float(noise, "noise")
    seed = check_seed(seed)
    rng = np.random.default_rng([seed, 0])
    proportions = rng.dirichlet(np.ones(len(INTERVALS)), size=num_clients)
    xs, ys, ws = zip(*(_draw_points(rng, p, per_client, noise) for p in proportions), strict=True)
    parts = [np.arange(m * per_client, (m + 1) * per_client) for m in range(num_clients)]
    return IntervalRegression(
        np.concatenate(xs), np.concatenate(ys), parts, proportions, np.concatenate(ws), noise
    )


def interval_regression_test(
    proportions, num_points: int, *, noise: float = 0.3, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Fresh noisy test points ``(x float32 [n, 1], y float32 [n])`` from the federation's pooled mixture:
    the interval probabilities are the mean of the clients' ``proportions`` (``[M, 3]``; the pooled data of
    equal-size clients), ``x`` uniform inside the interval, ``y = f(x) + N(0, noise²)``. Seeded by
    ``default_rng([seed, 1])``, a stream the training data never uses.

    Raises:
      ValueError: naming the argument out of range.
    """
    num_points = check_positive_int(num_points, "num_points")
    noise = check_nonneg_float(noise, "noise")
    seed = check_seed(seed)
    props = np.asarray(proportions, np.float64)
    if props.ndim != 2 or props.shape[1] != len(INTERVALS) or props.shape[0] < 1:
        raise ValueError(f"proportions must have shape [num_clients, {len(INTERVALS)}]; got {props.shape}.")
    if not (np.all(np.isfinite(props)) and np.all(props >= 0)) or np.any(props.sum(axis=1) <= 0):
        raise ValueError("proportions must be finite, non-negative, with positive row sums.")
    mix = (props / props.sum(axis=1, keepdims=True)).mean(axis=0)
    x, y, _ = _draw_points(np.random.default_rng([seed, 1]), mix / mix.sum(), num_points, noise)
    return x, y
