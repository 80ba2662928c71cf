"""Flat parameter layouts (sidejax.layout): leaf order, per-tensor reductions against numpy, under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from sidejax.layout import flat_layout, tensor_max_abs, tensor_norms

PARAMS = {"b": jnp.zeros((2, 3)), "a": jnp.zeros(4), "c": {"k": jnp.zeros((1, 2, 2))}}


def test_layout_follows_ravel_pytree_leaf_order():
    layout = flat_layout(PARAMS)
    assert layout.dim == 14 and layout.num_tensors == 3
    # pytree order is by sorted keys: a (4), b (2 x 3), c/k (1 x 2 x 2)
    np.testing.assert_array_equal(layout.tensor_sizes, [4, 6, 4])
    np.testing.assert_array_equal(layout.tensor_starts, [0, 4, 10])
    np.testing.assert_array_equal(layout.tensor_ids, [0] * 4 + [1] * 6 + [2] * 4)
    flat = jnp.arange(14.0)
    tree = layout.unravel(flat)
    assert jax.tree.map(jnp.shape, tree) == jax.tree.map(jnp.shape, PARAMS)
    np.testing.assert_array_equal(ravel_pytree(tree)[0], flat)
    np.testing.assert_array_equal(tree["b"], np.arange(4.0, 10.0).reshape(2, 3))


def test_tensor_norms_and_max_abs_match_numpy_under_jit():
    layout = flat_layout(PARAMS)
    v = jax.random.normal(jax.random.key(0), (14,))
    norms, max_abs = jax.jit(lambda v: (tensor_norms(v, layout), tensor_max_abs(v, layout)))(v)
    x = np.asarray(v, np.float64)
    pieces = np.split(x, np.cumsum(layout.tensor_sizes)[:-1])
    np.testing.assert_allclose(norms, [np.linalg.norm(p) for p in pieces], rtol=1e-6)
    np.testing.assert_array_equal(max_abs, np.asarray([np.abs(p).max() for p in pieces], np.float32))
