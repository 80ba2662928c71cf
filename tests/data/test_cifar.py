"""CIFAR-10 and CIFAR-100 from tiny fake pickle batches (sidejax.data.cifar)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fake_cifar_batch

from sidejax.data import (
    load_dataset,
)


@pytest.mark.parametrize("point_at_folder", [False, True])
def test_cifar10_from_fake_batches(tmp_path, no_local_data, point_at_folder):
    folder = tmp_path / "c" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = [fake_cifar_batch(folder / f"data_batch_{i}", 2, b"labels", i) for i in range(1, 6)]
    fake_cifar_batch(folder / "test_batch", 3, b"labels", 9)
    ds = load_dataset("cifar10", data_dir=folder if point_at_folder else folder.parent)
    assert ds.x.shape == (10, 32, 32, 3) and ds.x.dtype == np.float32 and ds.num_classes == 10
    data0 = batches[0][0][0]
    # Pixel (row 1, col 2) of each channel of the first image: CHW flat offset c*1024 + 1*32 + 2.
    np.testing.assert_allclose(ds.x[0, 1, 2], data0[[34, 1024 + 34, 2048 + 34]] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y[:2], batches[0][1])
    assert load_dataset("cifar10", "test", data_dir=folder).x.shape == (3, 32, 32, 3)


def test_cifar100_fine_labels(tmp_path, no_local_data):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    _, labels = fake_cifar_batch(folder / "train", 4, b"fine_labels", 0)
    ds = load_dataset("cifar100", data_dir=tmp_path)
    assert ds.num_classes == 100 and ds.x.shape == (4, 32, 32, 3)
    np.testing.assert_array_equal(ds.y, labels)
