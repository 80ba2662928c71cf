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
