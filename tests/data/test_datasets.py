"""The dataset registry and search path (sidejax.data.datasets): names, splits and keyword arguments,
where file-based datasets are looked for, and the errors that say how to get them.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fake_mnist

from sidejax.data import (
    DATASETS,
    dataset_available,
    load_dataset,
)


def test_datasets_tuple():
    assert DATASETS == (
        "digits",
        "moons",
        "synthetic_linear",
        "synthetic_logistic",
        "mnist",
        "fashion_mnist",
        "emnist",
        "cifar10",
        "cifar100",
    )


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError, match="name") as info:
        load_dataset("imagenet")
    for name in DATASETS:
        assert name in str(info.value)


def test_bad_split():
    with pytest.raises(ValueError, match="split") as info:
        load_dataset("digits", "validation")
    assert "train" in str(info.value) and "test" in str(info.value)


def test_bad_kwargs():
    with pytest.raises(ValueError, match="dim"):
        load_dataset("moons", dim=3)
    with pytest.raises(ValueError, match="num_samples"):
        load_dataset("synthetic_linear", num_samples=0)
    with pytest.raises(ValueError, match="subset"):
        load_dataset("emnist", subset="nope")


def test_mnist_found_via_env_subfolder(tmp_path, no_local_data):
    d = tmp_path / "env" / "fashion_mnist"
    d.mkdir()
    fake_mnist(d, "train-images-idx3-ubyte", "train-labels-idx1-ubyte", 3, 10, gz=False)
    fake_mnist(d, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 2, 10, gz=False)
    assert dataset_available("fashion_mnist")
    assert load_dataset("fashion_mnist", "test").x.shape == (2, 28, 28, 1)


def test_missing_files_error_lists_places(tmp_path, no_local_data):
    data_dir = tmp_path / "nothing_here"
    data_dir.mkdir()
    assert not dataset_available("mnist", data_dir=data_dir)
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("mnist", data_dir=data_dir)
    msg = str(info.value)
    assert str(data_dir) in msg
    assert str(tmp_path / "env") in msg
    assert str(tmp_path / "home" / ".cache" / "sidejax" / "mnist") in msg
    assert str(tmp_path / "debian" / "mnist") in msg
    assert "train-images-idx3-ubyte" in msg and "train-labels-idx1-ubyte" in msg
    assert "SIDEJAX_DATA_DIR" in msg and "download=True" in msg


def test_missing_fashion_mnist_mentions_apt(no_local_data):
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_dataset("fashion_mnist", "test")


@pytest.mark.skipif(not dataset_available("fashion_mnist"), reason="Fashion-MNIST files not found locally")
def test_fashion_mnist_real_files():
    train = load_dataset("fashion_mnist", "train")
    test = load_dataset("fashion_mnist", "test")
    assert train.x.shape == (60000, 28, 28, 1) and test.x.shape == (10000, 28, 28, 1)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int32 and train.num_classes == 10
    assert 0.0 <= train.x.min() and train.x.max() <= 1.0
    assert set(np.unique(train.y)) == set(range(10)) and set(np.unique(test.y)) == set(range(10))
    np.testing.assert_array_equal(np.bincount(train.y), np.full(10, 6000))
