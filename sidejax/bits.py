"""Code lengths, computed from payloads inside jit.

A reported bit count in sidejax is always the length of a message that was actually built: the payload
arrays that cross the wire are fixed-width words, and their length is ``sum(size * bit_width)`` over the
payload's leaves. Ideal rates (KL in bits, entropy bounds) are reported beside these numbers, in ``*Info``
fields, and labelled as such.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from sidejax.types import Bits, PyTree

__all__ = [
    "LN2",
    "BITS_DTYPE",
    "MAX_MESSAGE_BITS",
    "as_bits",
    "payload_bits",
    "bits_to_nats",
    "nats_to_bits",
    "binary_entropy_bits",
    "enumerative_mask_bits",
    "check_capacity_bits",
]

LN2 = math.log(2.0)
#: the dtype of every message length (``Message.num_bits``): an exact integer count. float32, the dtype
#: used before, counts exactly only up to 2**24 bits (2 MiB): the float32 downlink of a 2.26 M-parameter
#: model (72 M bits) lost its last bit, so the protocol bit after it read as 0 (found by make gpu-check)
BITS_DTYPE = jnp.int32
#: the longest message a length can describe (256 MiB); longer capacities are refused where they are built
MAX_MESSAGE_BITS = 2**31 - 1


def as_bits(num_bits) -> jax.Array:
    """``num_bits`` as a message length (:data:`BITS_DTYPE`). A float is taken as the whole number it holds;
    a float that is not a whole number ``>= 0`` is not a length and becomes ``-1``, which no stream's length
    equals, so every receiver's length check still rejects it (as it did while lengths were float32)."""
    x = jnp.asarray(num_bits)
    if jnp.issubdtype(x.dtype, jnp.floating):
        whole = (x >= 0) & (x == jnp.floor(x))
        x = jnp.where(whole, jnp.minimum(x, MAX_MESSAGE_BITS), -1)
    return x.astype(BITS_DTYPE)


def payload_bits(payload: PyTree) -> Bits:
    """Length in bits of a payload made of fixed-width words.

    Every leaf contributes ``leaf.size * 8 * leaf.dtype.itemsize``: a ``uint32[d]`` payload is ``32 d`` bits.
    The count is derived from the arrays themselves (shapes and dtypes), so it cannot drift from what is sent.

    Args:
      payload: a pytree of arrays (the words on the wire).

    Returns:
      int32 scalar (:data:`BITS_DTYPE`): the number of bits.

    Raises:
      ValueError: if the payload is longer than :data:`MAX_MESSAGE_BITS`.
    """
    total = 0
    for leaf in jax.tree.leaves(payload):
        total += int(leaf.size) * 8 * jnp.dtype(leaf.dtype).itemsize
    check_capacity_bits(total, "payload")
    return jnp.asarray(total, BITS_DTYPE)


def check_capacity_bits(bits: int, what: str) -> None:
    """Refuses a static capacity of more than :data:`MAX_MESSAGE_BITS` bits (``what`` names it)."""
    if bits > MAX_MESSAGE_BITS:
        raise ValueError(
            f"{what} of {bits:,} bits is longer than a message can be ({MAX_MESSAGE_BITS:,} bits, 256 MiB): "
            "split the vector into several messages"
        )


def bits_to_nats(bits):
    """Converts bits to nats (multiplies by ln 2)."""
    return bits * LN2


def nats_to_bits(nats):
    """Converts nats to bits (divides by ln 2)."""
    return nats / LN2


def binary_entropy_bits(x: jax.Array) -> jax.Array:
    """:math:`H_b(x)` in bits (0 at 0 and 1)."""
    return -(xlogy(x, x) + xlogy(1 - x, 1 - x)) / LN2


def enumerative_mask_bits(mask: jax.Array) -> jax.Array:
    """Ideal length (a bound, not a stream) of the two-part enumerative code of a binary ``mask[d]`` with
    ``k`` ones: ``ceil(log2(d + 1))`` bits for ``k``, then ``ceil(log2 C(d, k))`` bits for the mask's index
    among all masks with ``k`` ones, the cost of an ideal arithmetic code with the empirical frequency
    (FedPM's accounting, :math:`d H_b(k/d) + \\log_2 d`, is an upper bound on it). Computed with ``lgamma``
    in float32 (error well under one bit for ``d`` up to ~10^7). The stream sidejax sends for a mask is
    :func:`sidejax.coding.lossless.mask_encode`; this is reported beside it, labelled ideal."""
    d = mask.shape[0]
    k = jnp.sum(mask > 0.5).astype(jnp.float32)
    lg = jax.lax.lgamma
    log2_binom = (lg(jnp.float32(d + 1)) - lg(k + 1) - lg(d - k + 1)) / LN2
    header = float(math.ceil(math.log2(d + 1)))
    return header + jnp.ceil(jnp.maximum(log2_binom - 1e-3, 0.0))
