"""How a parameter pytree maps to the flat vector the coders work on.

:class:`FlatLayout` follows pytree leaf order, as :func:`jax.flatten_util.ravel_pytree`, and records the
tensor (leaf) of every coordinate, for per-tensor side information (QSGD norms, SignSGD scales).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from sidejax.types import Params

__all__ = ["FlatLayout", "flat_layout", "tensor_norms", "tensor_max_abs"]


class FlatLayout(NamedTuple):
    """Static description of a parameter pytree as a flat vector.

    Attributes:
      dim: number of coordinates.
      tensor_ids: int32 numpy ``[dim]``: the leaf (tensor) each coordinate belongs to.
      tensor_sizes: numpy ``[num_tensors]``.
      tensor_starts: numpy ``[num_tensors]``: first coordinate of each tensor.
      unravel: flat vector -> pytree.
    """

    dim: int
    tensor_ids: np.ndarray
    tensor_sizes: np.ndarray
    tensor_starts: np.ndarray
    unravel: object

    @property
    def num_tensors(self) -> int:
        return int(self.tensor_sizes.shape[0])


def flat_layout(params: Params) -> FlatLayout:
    """The :class:`FlatLayout` of ``params`` (shapes only are used)."""
    flat, unravel = ravel_pytree(params)
    sizes = np.array([int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params)], np.int64)
    ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return FlatLayout(int(flat.shape[0]), ids, sizes, starts, unravel)


def tensor_norms(v: jax.Array, layout: FlatLayout) -> jax.Array:
    """``[num_tensors]`` Euclidean norms of each tensor's slice of the flat ``v``."""
    sq = jax.ops.segment_sum(v * v, layout.tensor_ids, layout.num_tensors, indices_are_sorted=True)
    return jnp.sqrt(sq)


def tensor_max_abs(v: jax.Array, layout: FlatLayout) -> jax.Array:
    """``[num_tensors]`` max absolute value of each tensor's slice."""
    return jax.ops.segment_max(jnp.abs(v), layout.tensor_ids, layout.num_tensors, indices_are_sorted=True)
