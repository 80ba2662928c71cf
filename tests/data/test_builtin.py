"""Datasets that need no files (sidejax.data.builtin): digits, moons, the synthetic regressions."""

from __future__ import annotations

import numpy as np
import pytest

from sidejax.data import (
    load_dataset,
    synthetic_regression,
)


def test_digits_shapes_dtypes_and_split():
    train = load_dataset("digits", "train")
    test = load_dataset("digits", "test")
    assert train.x.shape == (1437, 8, 8, 1) and test.x.shape == (360, 8, 8, 1)
    assert train.y.shape == (1437,) and test.y.shape == (360,)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int32
    assert train.num_classes == test.num_classes == 10
    for ds in (train, test):
        assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0 and ds.x.max() == 1.0
        assert set(np.unique(ds.y)) == set(range(10))
    again = load_dataset("digits", "train")
    np.testing.assert_array_equal(train.x, again.x)
    np.testing.assert_array_equal(train.y, again.y)


def test_moons():
    train = load_dataset("moons")
    test = load_dataset("moons", "test")
    assert train.x.shape == (1000, 2) and train.x.dtype == np.float32
    assert train.y.shape == (1000,) and train.y.dtype == np.int32 and train.num_classes == 2
    assert not np.array_equal(train.x, test.x)
    small = load_dataset("moons", num_samples=50, noise=0.0, seed=3)
    assert small.x.shape == (50, 2)


@pytest.mark.parametrize("kind", ["linear", "logistic"])
def test_synthetic_shapes_and_determinism(kind):
    name = f"synthetic_{kind}"
    a = load_dataset(name, num_samples=200, dim=5, seed=7)
    b = load_dataset(name, num_samples=200, dim=5, seed=7)
    c = load_dataset(name, num_samples=200, dim=5, seed=8)
    assert a.x.shape == (200, 5) and a.x.dtype == np.float32 and a.y.shape == (200,)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    if kind == "linear":
        assert a.y.dtype == np.float32 and a.num_classes == 0
    else:
        assert a.y.dtype == np.int32 and a.num_classes == 2 and set(np.unique(a.y)) <= {0, 1}


def test_synthetic_linear_train_test_share_weights():
    train = synthetic_regression(100, 4, noise=0.0, seed=1, split="train")
    test = synthetic_regression(100, 4, noise=0.0, seed=1, split="test")
    assert not np.array_equal(train.x, test.x)
    w, *_ = np.linalg.lstsq(train.x.astype(np.float64), train.y.astype(np.float64), rcond=None)
    np.testing.assert_allclose(test.x @ w, test.y, atol=1e-4)


# --- BPC-FL's three-interval regression (docs/papers/bpcfl.md#s5-1, docs/papers/bpcfl.md#s8-15) ---


def _in_intervals(x):
    from sidejax.data import INTERVALS

    x = np.asarray(x, np.float64).ravel()
    inside = np.zeros(x.shape, bool)
    for lo, hi in INTERVALS:
        inside |= (x >= np.float32(lo)) & (x <= np.float32(hi))
    return inside


def test_interval_regression_shapes_intervals_and_parts():
    from sidejax.data import interval_regression

    d = interval_regression(5, 100, seed=0)
    assert d.x.shape == (500, 1) and d.x.dtype == np.float32
    assert d.y.shape == (500,) and d.y.dtype == np.float32
    assert len(d.parts) == 5 and all(len(p) == 100 for p in d.parts)
    np.testing.assert_array_equal(np.concatenate(d.parts), np.arange(500))
    assert d.proportions.shape == (5, 3)
    np.testing.assert_allclose(d.proportions.sum(axis=1), 1.0)
    assert np.all(_in_intervals(d.x))
    # each point lies inside the interval it was drawn from
    from sidejax.data import INTERVALS

    bounds = np.asarray(INTERVALS, np.float32)
    lo, hi = bounds[d.interval, 0], bounds[d.interval, 1]
    assert np.all((d.x[:, 0] >= lo) & (d.x[:, 0] <= hi))


def test_interval_regression_determinism_and_dirichlet_proportions_differ():
    from sidejax.data import interval_regression

    a = interval_regression(5, 50, seed=3)
    b = interval_regression(5, 50, seed=3)
    c = interval_regression(5, 50, seed=4)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    np.testing.assert_array_equal(a.proportions, b.proportions)
    assert not np.array_equal(a.x, c.x) and not np.array_equal(a.proportions, c.proportions)
    # Dirichlet([1,1,1]) per client: the clients' proportions differ, and so do their empirical mixtures
    assert np.unique(a.proportions.round(6), axis=0).shape[0] == 5
    counts = np.stack([np.bincount(a.interval[p], minlength=3) for p in a.parts])
    assert np.unique(counts, axis=0).shape[0] > 1


def test_interval_regression_noise_is_a_std():
    from sidejax.data import interval_regression, interval_target

    n = 20_000
    d = interval_regression(4, n // 4, noise=0.3, seed=11)
    resid = d.y.astype(np.float64) - interval_target(d.x[:, 0])
    # the sample std of N(0, 0.3^2) has SE about 0.3 / sqrt(2 n) = 1.5e-3; allow 4 SE (plus float32 round-off)
    se = 0.3 / np.sqrt(2 * n)
    assert abs(resid.std() - 0.3) < 4 * se + 1e-5
    assert abs(resid.mean()) < 4 * 0.3 / np.sqrt(n)
    zero = interval_regression(2, 10, noise=0.0, seed=1)
    np.testing.assert_allclose(zero.y, interval_target(zero.x[:, 0]), atol=1e-6)


def test_interval_target_values():
    from sidejax.data import interval_target

    np.testing.assert_allclose(interval_target(0.0), 1.5)
    np.testing.assert_allclose(interval_target(0.5), 1.5 * np.sin(0.2 * np.pi) - 1.5, atol=1e-12)


def test_interval_regression_test_set_is_fresh_and_from_the_mixture():
    from sidejax.data import interval_regression, interval_regression_test

    d = interval_regression(5, 100, seed=0)
    x, y = interval_regression_test(d.proportions, 3000, seed=0)
    assert x.shape == (3000, 1) and x.dtype == np.float32 and y.shape == (3000,) and y.dtype == np.float32
    assert np.all(_in_intervals(x))
    assert not np.isin(x[:, 0], d.x[:, 0]).any()
    # an interval no client draws from never appears
    props = np.array([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]])
    x2, _ = interval_regression_test(props, 500, seed=1)
    assert np.all(x2[:, 0] < 0.0 + 1e-6)
    x3, y3 = interval_regression_test(d.proportions, 3000, seed=0)
    np.testing.assert_array_equal(x, x3)
    np.testing.assert_array_equal(y, y3)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_clients=0, per_client=10), "num_clients"),
        (dict(num_clients=2.5, per_client=10), "num_clients"),
        (dict(num_clients=2, per_client=0), "per_client"),
        (dict(num_clients=2, per_client=10, noise=-0.1), "noise"),
        (dict(num_clients=2, per_client=10, seed=-1), "seed"),
    ],
)
def test_interval_regression_bad_arguments(kwargs, name):
    from sidejax.data import interval_regression

    with pytest.raises(ValueError, match=name):
        interval_regression(**kwargs)


def test_interval_regression_test_bad_arguments():
    from sidejax.data import interval_regression_test

    ok = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="num_points"):
        interval_regression_test(ok, 0)
    with pytest.raises(ValueError, match="proportions"):
        interval_regression_test(np.ones((2, 2)), 10)
    with pytest.raises(ValueError, match="proportions"):
        interval_regression_test(-ok, 10)
    with pytest.raises(ValueError, match="noise"):
        interval_regression_test(ok, 10, noise=-1.0)
