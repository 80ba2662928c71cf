"""FederatedData (sidejax.data.federated): the padded per-client index table and its checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.data import (
    FederatedData,
    class_counts,
    client_sizes,
    dirichlet_partition,
    make_federated_data,
    max_examples,
    num_clients,
)


def test_make_federated_data_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 3, 2)).astype(np.float32)
    y = rng.integers(0, 5, size=60)
    parts = dirichlet_partition(y, 4, alpha=0.5, seed=1)
    fd = make_federated_data(x, y, parts)
    assert isinstance(fd, FederatedData)
    assert num_clients(fd) == 4 and max_examples(fd) == max(p.size for p in parts)
    np.testing.assert_array_equal(client_sizes(fd), [p.size for p in parts])
    assert fd.client_indices.dtype == jnp.int32 and fd.num_examples.dtype == jnp.int32
    assert fd.y.dtype == jnp.int32 and fd.x.dtype == jnp.float32 and fd.x.shape == x.shape
    table, counts = np.asarray(fd.client_indices), np.asarray(fd.num_examples)
    for c, p in enumerate(parts):
        np.testing.assert_array_equal(table[c, : counts[c]], p)
        np.testing.assert_array_equal(table[c, counts[c] :], 0)
        np.testing.assert_array_equal(np.asarray(fd.x)[table[c, : counts[c]]], x[p])

    # The intended usage: vmap over (client_indices, num_examples) with masked gathers inside jit.
    def masked_label_sum(idx, n):
        mask = jnp.arange(idx.shape[0]) < n
        return jnp.sum(jnp.where(mask, fd.y[idx], 0))

    sums = jax.jit(jax.vmap(masked_label_sum))(fd.client_indices, fd.num_examples)
    np.testing.assert_array_equal(np.asarray(sums), [y[p].sum() for p in parts])


def test_make_federated_data_float_targets():
    fd = make_federated_data(np.zeros((5, 2)), np.linspace(0, 1, 5), [np.array([0, 1]), np.array([2, 3, 4])])
    assert fd.y.dtype == jnp.float32


def test_make_federated_data_errors():
    x, y = np.zeros((10, 2), np.float32), np.arange(10)
    with pytest.raises(ValueError, match="client 1"):
        make_federated_data(x, y, [np.arange(5), np.array([], dtype=np.int64), np.arange(5, 10)])
    with pytest.raises(ValueError, match="client_partition"):
        make_federated_data(x, y, [np.array([0, 10])])
    with pytest.raises(ValueError, match="x and y"):
        make_federated_data(x, y[:9], [np.arange(5)])
    with pytest.raises(ValueError, match="client_partition"):
        make_federated_data(x, y, [])


def test_class_counts_errors():
    with pytest.raises(ValueError, match="num_classes"):
        class_counts(np.array([0, 1]), [np.array([0, 1])], 0)
    with pytest.raises(ValueError, match="labels"):
        class_counts(np.array([0, 5]), [np.array([0, 1])], 3)
