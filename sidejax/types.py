"""Type aliases shared across sidejax (documentation only; nothing here is checked at run time)."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["Array", "PRNGKey", "Params", "PyTree", "Bits"]

Array = jax.Array
PRNGKey = jax.Array  # always a typed key from jax.random.key
Params = Any  # a pytree of arrays
PyTree = Any
Bits = jax.Array  # int32 scalar (or per-client vector) of bits, exact, computed inside jit (sidejax.bits)
