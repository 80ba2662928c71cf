"""Shared test helpers (importable from every test module: ``pythonpath = ["tests"]`` in pyproject.toml)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BASE", "tree_equal", "assert_trees_close_across_programs"]

#: The base key of the shared FedAvg run (conftest ``fedavg_ten_rounds``) and of the engine tests.
BASE = jax.random.key(42)


def tree_equal(a, b) -> bool:
    """Bit equality of two pytrees (NaNs equal; key leaves are skipped: they are compared by their data
    where it matters)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(la, lb, strict=True)
        if not jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key)
    )


def assert_trees_close_across_programs(a, b, ulps: int) -> None:
    """``a`` and ``b`` come from two differently compiled programs computing the same thing.

    XLA may fuse, vectorise and order float reductions differently in two programs (and differently on
    another CPU), so their floats agree to a few units in the last place, not bit for bit: on another
    machine of the same kind the one-step FedAvg test differed by 1-3 ULP on 9 of its 2,778 weights.
    Float leaves must agree within ``ulps`` ULPs of the leaf's largest magnitude (rounding errors are
    absolute at the scale of the sums that produce them, so an entry near zero is not held to its own, much
    finer, spacing); integer and bool leaves (client ids, step counts, flags) and key leaves must be equal.
    """
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            scale = np.spacing(np.max(np.abs(y), initial=np.finfo(y.dtype).tiny).astype(y.dtype))
            np.testing.assert_allclose(x, y, rtol=0, atol=ulps * float(scale))
        else:
            np.testing.assert_array_equal(x, y)
