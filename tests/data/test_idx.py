"""The MNIST family's IDX files (sidejax.data.idx): the parser and its errors, and MNIST/EMNIST from tiny
fake files.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fake_mnist, idx_bytes, write_idx

from sidejax.data import (
    dataset_available,
    load_dataset,
    read_idx,
)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int32])
def test_idx_round_trip(tmp_path, gz, dtype):
    arr = (np.arange(2 * 3 * 4) * 7 - 5).astype(dtype).reshape(2, 3, 4)
    path = tmp_path / ("a.idx.gz" if gz else "a.idx")
    write_idx(path, arr, gz=gz)
    out = read_idx(path)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    np.testing.assert_array_equal(out, arr)
    out[0, 0, 0] = 1  # writable copy


def test_idx_truncated_plain(tmp_path):
    path = tmp_path / "trunc-idx3-ubyte"
    path.write_bytes(idx_bytes(np.zeros((3, 4, 4), np.uint8))[:-5])
    with pytest.raises(ValueError, match="trunc-idx3-ubyte") as info:
        read_idx(path)
    assert "truncated" in str(info.value)


def test_idx_truncated_gz(tmp_path):
    good = tmp_path / "good.gz"
    write_idx(good, np.arange(500, dtype=np.uint8).reshape(5, 100), gz=True)
    bad = tmp_path / "bad-labels.gz"
    bad.write_bytes(good.read_bytes()[:-12])
    with pytest.raises(ValueError, match="bad-labels.gz"):
        read_idx(bad)


def test_idx_bad_magic_and_code(tmp_path):
    path = tmp_path / "magic"
    path.write_bytes(b"\x01\x00\x08\x01" + np.array([1], ">u4").tobytes() + b"\x00")
    with pytest.raises(ValueError, match="magic"):
        read_idx(path)
    path.write_bytes(b"\x00\x00\x07\x01" + np.array([1], ">u4").tobytes() + b"\x00")
    with pytest.raises(ValueError, match="type code"):
        read_idx(path)


def test_mnist_from_fake_files(tmp_path, no_local_data):
    d = tmp_path / "mnist_files"
    d.mkdir()
    images, labels = fake_mnist(d, "train-images-idx3-ubyte", "train-labels-idx1-ubyte", 6, 10, gz=True)
    fake_mnist(d, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 4, 10, gz=False)
    assert dataset_available("mnist", data_dir=d)
    train = load_dataset("mnist", data_dir=d)
    test = load_dataset("mnist", "test", data_dir=d)
    assert train.x.shape == (6, 28, 28, 1) and test.x.shape == (4, 28, 28, 1)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int32 and train.num_classes == 10
    np.testing.assert_allclose(train.x[..., 0], images / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(train.y, labels)


def test_emnist_letters_transposed_and_shifted(tmp_path, no_local_data):
    d = tmp_path / "emnist"
    d.mkdir()
    images, labels = fake_mnist(
        d,
        "emnist-letters-train-images-idx3-ubyte",
        "emnist-letters-train-labels-idx1-ubyte",
        5,
        26,
        gz=True,
        label_offset=1,
    )
    ds = load_dataset("emnist", data_dir=d, subset="letters")
    assert ds.num_classes == 26
    np.testing.assert_array_equal(ds.y, labels.astype(np.int32) - 1)
    np.testing.assert_allclose(ds.x[..., 0], images.transpose(0, 2, 1) / 255.0, rtol=1e-6)
