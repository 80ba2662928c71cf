"""The TFDS fallback (sidejax.data.tfds): file-based datasets not found locally are loaded through
``tensorflow_datasets`` when it is installed, with the same conversion as the local files (a stand-in module
replaces TFDS here: the test runs without it and without a download)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from sidejax.data import load_dataset
from sidejax.data import tfds as tfds_module


@pytest.fixture
def fake_tfds(no_local_data, monkeypatch):
    """A stand-in ``tensorflow_datasets`` that records its calls and returns tiny uint8 image batches."""
    calls = []
    rng = np.random.default_rng(0)

    def load(name, *, split, batch_size, download, as_supervised):
        calls.append(
            dict(name=name, split=split, batch_size=batch_size, download=download, sup=as_supervised)
        )
        shape = (3, 32, 32, 3) if name.startswith("cifar") else (3, 28, 28, 1)
        labels = np.array([1, 2, 3]) if name == "emnist/letters" else np.array([0, 5, 9])
        return rng.integers(0, 256, size=shape, dtype=np.uint8), labels

    module = types.ModuleType("tensorflow_datasets")
    module.load = load
    module.as_numpy = lambda ds: ds
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", module)
    monkeypatch.setattr(tfds_module, "tfds_installed", lambda: True)
    return calls


def test_tfds_names():
    assert tfds_module.tfds_name("emnist", "letters") == "emnist/letters"
    assert tfds_module.tfds_name("fashion_mnist", "") == "fashion_mnist"


def test_missing_files_fall_back_to_tfds_with_the_same_conversion(fake_tfds):
    mnist = load_dataset("fashion_mnist", "test", download=True)
    assert fake_tfds[-1] == dict(name="fashion_mnist", split="test", batch_size=-1, download=True, sup=True)
    assert mnist.x.shape == (3, 28, 28, 1) and mnist.x.dtype == np.float32 and mnist.num_classes == 10
    assert mnist.y.dtype == np.int32 and mnist.y.tolist() == [0, 5, 9]
    assert 0.0 <= mnist.x.min() and mnist.x.max() <= 1.0
    letters = load_dataset("emnist", subset="letters")
    assert fake_tfds[-1]["name"] == "emnist/letters" and fake_tfds[-1]["download"] is False
    assert letters.num_classes == 26 and letters.y.tolist() == [0, 1, 2]  # 1..26 shifted to 0..25
    cifar = load_dataset("cifar100")
    assert cifar.x.shape == (3, 32, 32, 3) and cifar.num_classes == 100 and cifar.y.dtype == np.int32


def test_tfds_installed_reports_whether_it_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # `import` raises ImportError
    assert tfds_module.tfds_installed() is False
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", types.ModuleType("tensorflow_datasets"))
    assert tfds_module.tfds_installed() is True
