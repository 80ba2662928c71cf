"""Pieces shared by the compressed-update algorithms (FedPM, QSGD, SignSGD, Langevin; with and without KLMS).

- :class:`FlatLayout`: how a parameter pytree maps to the flat vector the coders work on (pytree leaf order,
  as :func:`jax.flatten_util.ravel_pytree`), with the tensor id of every coordinate for per-tensor side
  information (QSGD norms, SignSGD scales).
- :func:`tensor_norms`, :func:`tensor_max_abs`: per-tensor statistics broadcast back to coordinates.
- :func:`elias_gamma_bits`: the length of the Elias-gamma stream QSGD uses (Alistarh et al., 2017).
- :func:`enumerative_mask_bits`: the length of a two-part enumerative code of a binary mask (the
  arithmetic-coding cost FedPM reports).
- :func:`client_streams`: the private key's (training, sampling) streams (from :mod:`sidejax.keys`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.scipy.special import xlogy

from sidejax.bits import LN2
from sidejax.coding.base import decode_float32, encode_float32
from sidejax.keys import client_streams
from sidejax.klms import klms_downlink_bits
from sidejax.types import Params

__all__ = [
    "FlatLayout",
    "flat_layout",
    "tensor_norms",
    "tensor_max_abs",
    "elias_gamma_length",
    "elias_gamma_bits",
    "enumerative_mask_bits",
    "binary_entropy_bits",
    "client_streams",
    "broadcast_params",
]


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


def elias_gamma_length(n: jax.Array) -> jax.Array:
    """Length in bits of the Elias-gamma code of integers ``n >= 1``: ``2 floor(log2 n) + 1``."""
    n = jnp.maximum(n, 1).astype(jnp.uint32)
    floor_log2 = 31 - jax.lax.clz(n).astype(jnp.int32)
    return 2 * floor_log2 + 1


def elias_gamma_bits(levels: jax.Array, layout: FlatLayout) -> jax.Array:
    """Exact length of QSGD's Elias stream for quantised levels ``levels[dim]`` (ints, 0 = zero).

    Per tensor (its own norm, as the reference code quantises per tensor): 32 bits for the float32 norm,
    then for every nonzero coordinate the Elias-gamma code of the gap to the previous nonzero (first gap:
    position + 1), one sign bit, and the Elias-gamma code of the level (QSGD, Alistarh et al. 2017, §3.2).
    The length is computed from the symbols; the bit string itself is not built.
    """
    dim = levels.shape[0]
    idx = jnp.arange(dim, dtype=jnp.int32)
    start = jnp.asarray(layout.tensor_starts, jnp.int32)[jnp.asarray(layout.tensor_ids)]
    nz = levels != 0
    marked = jnp.where(nz, idx, start - 1)
    running = jax.lax.cummax(marked)
    prev = jnp.concatenate([jnp.array([-1], jnp.int32), running[:-1]])
    prev = jnp.maximum(prev, start - 1)  # previous nonzero within the tensor (or start - 1)
    gap = idx - prev
    per = elias_gamma_length(gap) + 1 + elias_gamma_length(jnp.abs(levels))
    return (jnp.sum(jnp.where(nz, per, 0)) + 32 * layout.num_tensors).astype(jnp.float32)


def enumerative_mask_bits(mask: jax.Array) -> jax.Array:
    """Length of the two-part enumerative code of a binary ``mask[d]`` with ``k`` ones.

    ``ceil(log2(d + 1))`` bits for ``k``, then ``ceil(log2 C(d, k))`` bits for the index of the mask among
    all masks with ``k`` ones. This is the cost of an ideal arithmetic code with the empirical frequency
    (FedPM's accounting, :math:`d H_b(k/d) + \\log_2 d` bits, is an upper bound on it). Computed from the
    mask with ``lgamma`` in float32 (error well under one bit for ``d`` up to ~10^7).
    """
    d = mask.shape[0]
    k = jnp.sum(mask > 0.5).astype(jnp.float32)
    lg = jax.lax.lgamma
    log2_binom = (lg(jnp.float32(d + 1)) - lg(k + 1) - lg(d - k + 1)) / LN2
    header = float(np.ceil(np.log2(d + 1)))
    return header + jnp.ceil(jnp.maximum(log2_binom - 1e-3, 0.0))


def binary_entropy_bits(x: jax.Array) -> jax.Array:
    """:math:`H_b(x)` in bits (0 at 0 and 1)."""
    return -(xlogy(x, x) + xlogy(1 - x, 1 - x)) / LN2


def broadcast_params(server, client_ids: jax.Array, klms_config=None, extra_bits=0.0):
    """The dense methods' downlink: ``server.params`` sent as float32 words (clients use the decoded copy),
    plus the KLMS protocol bits of ``server.klms`` when ``klms_config`` is given and ``extra_bits`` of other
    side information. Returns ``(server_as_received, bits[clients])``."""
    flat, unravel = ravel_pytree(server.params)
    msg = encode_float32(flat)
    bits = msg.num_bits + extra_bits
    if klms_config is not None:
        bits = bits + klms_downlink_bits(server.klms, klms_config)
    return server._replace(params=unravel(decode_float32(msg))), jnp.full(client_ids.shape, bits, jnp.float32)
