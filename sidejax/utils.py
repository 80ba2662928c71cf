"""Small pytree helpers used across sidejax."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.types import PyTree

__all__ = ["is_concrete", "tree_all_finite", "check_count", "stack_clients", "enable_x64"]


def is_concrete(tree: PyTree) -> bool:
    """True if every leaf of ``tree`` can be checked on the host now: a number, a numpy value or a concrete
    jax array; False inside ``jit``/``vmap`` (tracers) and for the placeholder leaves pytree utilities pass
    around. Public boundaries validate concrete inputs with it and leave traced ones to in-jit flags."""
    return all(
        not isinstance(leaf, jax.core.Tracer)
        and isinstance(leaf, (np.ndarray, np.generic, jax.Array, float, int))
        for leaf in jax.tree.leaves(tree)
    )


def tree_all_finite(tree: PyTree) -> jax.Array:
    """True iff every floating-point leaf of ``tree`` is finite (bool scalar, jit-friendly)."""
    flags = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def check_count(value, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) in ``[minimum, maximum]``; else ``ValueError``
    naming ``name`` and the valid range. For the counts builders take (clients, samples, rounds)."""
    bad = isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum
    if bad or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def stack_clients(tree: PyTree, num_clients: int) -> PyTree:
    """``tree`` repeated along a new leading axis of ``num_clients`` (every client's initial state)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients, *jnp.shape(a))), tree)


def enable_x64():
    """A context manager that enables 64-bit floats inside it (float64 references, A-IHT at tight
    tolerances): ``jax.enable_x64(True)`` on jax >= 0.7, ``jax.experimental.enable_x64()`` on older jax."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as experimental_enable_x64

    return experimental_enable_x64()
