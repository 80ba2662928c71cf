"""Small pytree helpers used across sidejax."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.types import PyTree

__all__ = [
    "is_concrete",
    "tree_all_finite",
    "check_count",
    "check_positive",
    "check_number",
    "check_settings",
    "stack_clients",
    "enable_x64",
    "masked_mean",
    "masked_sum",
    "keep_unless_none",
]


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


def check_positive(value, name: str) -> float:
    """``value`` as a ``float`` if it is a finite real number ``> 0`` (not a bool); else ``ValueError`` naming
    ``name``. For the static scales of lattices, noise laws and normalisations."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    return float(value)


def check_number(value, name: str, requirement: str, ok) -> float:
    """``value`` as a ``float`` if it is a host number (a Python or NumPy number or a concrete one-element
    array; not a bool) for which ``ok(float(value))`` holds; else ``ValueError`` naming ``name`` and
    ``requirement``. For the settings builders take (a learning rate, a clip, a constant): host values by
    contract, checked where they enter, so a traced value (inside ``jit``) is refused like any non-number."""
    try:
        x = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):  # not a number; a tracer's float() raises a TypeError too
        x = None
    if x is None or not ok(x):
        raise ValueError(f"{name} must be {requirement}, got {value!r}")
    return x


def check_settings(
    settings, settings_type: type, *, positive: tuple[str, ...] = (), counts: tuple[str, ...] = ()
):
    """``settings`` if it is a ``settings_type`` whose ``positive`` fields are finite numbers ``> 0``
    (:func:`check_positive`) and whose ``counts`` fields are integers ``>= 1`` (:func:`check_count`); else
    ``ValueError`` naming ``settings.<field>``."""
    if not isinstance(settings, settings_type):
        raise ValueError(f"settings must be a {settings_type.__name__}, got {type(settings).__name__}")
    for name in positive:
        check_positive(getattr(settings, name), f"settings.{name}")
    for name in counts:
        check_count(getattr(settings, name), f"settings.{name}")
    return settings


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


def _rows(mask: jax.Array, values: jax.Array) -> jax.Array:
    return jnp.asarray(mask, bool).reshape(mask.shape + (1,) * (values.ndim - 1))


def masked_sum(values: jax.Array, include: jax.Array) -> jax.Array:
    """``sum_i values[i]`` over the rows ``i`` with ``include[i]`` True (axis 0). Excluded rows are replaced
    by zeros before the sum (never multiplied: a NaN row times 0 is NaN), so the result is the sum over the
    included rows alone, bit for bit, and equals ``jnp.sum(values, 0)`` when every row is included."""
    values = jnp.asarray(values)
    include = jnp.asarray(include, bool)
    masked = jnp.sum(jnp.where(_rows(include, values), values, jnp.zeros((), values.dtype)), axis=0)
    # with every row included, the plain sum itself: XLA may order a reduction fused with the select
    # differently, and runs without exclusions must keep their bits
    return jnp.where(jnp.all(include), jnp.sum(values, axis=0), masked)


def masked_mean(values: jax.Array, include: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The aggregate every server takes over its participants (axis 0), renormalised over the included
    ones: with ``weights`` None the unweighted mean :math:`\\frac{1}{|I|}\\sum_{i \\in I} v_i`, else
    :math:`\\sum_{i \\in I} w_i v_i / \\sum_{i \\in I} w_i`; ``I = {i : include[i]}``. With every row
    included it is ``jnp.mean(values, 0)`` / ``tensordot(w / sum(w), values)`` themselves (selected, not
    rewritten), so runs without excluded clients keep their bits. With none included the result is not
    finite (0/0): callers keep their previous state (:func:`keep_unless_none`)."""
    values = jnp.asarray(values)
    include = jnp.asarray(include, bool)
    everyone = jnp.all(include)
    if weights is None:
        masked = masked_sum(values, include) / jnp.sum(include).astype(values.dtype)
        return jnp.where(everyone, jnp.mean(values, axis=0), masked)
    weights = jnp.asarray(weights, values.dtype)
    w = jnp.where(include, weights, 0)
    w = w / jnp.sum(w)
    masked = jnp.tensordot(w, jnp.where(_rows(include, values), values, jnp.zeros((), values.dtype)), axes=1)
    return jnp.where(everyone, jnp.tensordot(weights / jnp.sum(weights), values, axes=1), masked)


def keep_unless_none(include: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` if any participant is included, else ``old`` (every leaf): a server none of whose
    participants is included keeps its previous state."""
    anyone = jnp.any(jnp.asarray(include, bool))

    def pick(a, b):
        if not isinstance(a, jax.Array | np.ndarray | np.generic):
            return a  # a static Python value (a shape, a size): the same in both
        if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            data = jnp.where(anyone, jax.random.key_data(a), jax.random.key_data(b))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
        return jnp.where(anyone, a, b).astype(jnp.result_type(a))

    return jax.tree.map(pick, new, old)
