"""Deterministic compressors of a vector, as coders: the non-stochastic baselines' messages.

:func:`scaled_sign_coder` sends the scaled sign (Karimireddy et al. 2019, "EF-SignSGD"; the compressor of
every non-stochastic baseline of the BICompFL paper, docs/papers/bicompfl.md#s4-1)

.. math::

    C(v) = \\frac{\\|v\\|_1}{d}\\, \\mathrm{sign}(v), \\qquad \\mathrm{sign}(0) = +1,

as one float32 scale followed by ``d`` sign bits: ``32 + d`` bits for a vector of ``d`` coordinates.

:func:`topk_coder` sends TopK (M3's uplink compressor, docs/papers/bicompfl.md#s4-3): the
:math:`K = \\lfloor d / m \\rfloor` coordinates of largest magnitude (``m`` the coder's ``divisor``; at least
one), the others zero,

.. math::

    \\mathrm{TopK}(v)_j = v_j \\ \\text{if } j \\in \\mathrm{argtop}_K |v|, \\qquad 0 \\ \\text{otherwise},

as the ``K`` values in float32 followed by their ``K`` positions in ascending order, each in
``ceil(log2 d)`` bits: ``K (32 + ceil(log2 d))`` bits. (A position set coded by its rank among the
:math:`\\binom{d}{K}` subsets would take :math:`\\log_2 \\binom{d}{K} \\approx d\\,H(K/d)` bits, 0.47 bits per
coordinate at ``K = d/10`` against 1.6 here; the fixed width keeps the length independent of the values, which
an error-feedback compressor needs, :func:`sidejax.algorithms.compressed.check_compressor`.)

It is a *deterministic, biased* compressor, not a sample of ``q``: ``q`` is the point mass at ``v``
(:class:`sidejax.distributions.PointMass`) and the decoder returns :math:`C(v) \\ne v`. The methods that use
it carry the difference in an error-feedback memory (:mod:`sidejax.algorithms.compressed`). The keys and
``p`` are not used (only ``p``'s length, which the receiver knows).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax.bits import as_bits
from sidejax.coding.base import (
    Coder,
    Float32Info,
    Message,
    StreamCheck,
    failed_checks,
    stateless_coder,
)
from sidejax.coding.bitstream import mask_to_length, num_words, pack_fixed, sent_words, unpack_fixed
from sidejax.distributions import dist_dim, is_valid
from sidejax.utils import check_count

__all__ = [
    "ScaledSignInfo",
    "scaled_sign",
    "scaled_sign_bits",
    "scaled_sign_coder",
    "topk_count",
    "topk_index_bits",
    "topk_bits",
    "topk",
    "topk_coder",
]


class ScaledSignInfo(NamedTuple):
    """Encoder diagnostics: ``valid`` (``v`` and its scale are finite) and ``ideal_bits`` (NaN: the
    compressor is deterministic, there is no ideal rate to report)."""

    valid: jax.Array
    ideal_bits: jax.Array


def scaled_sign(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The scaled sign of ``v`` as ``(scale, negative)``: ``scale = sum(|v|) / d`` (float32) and the bool
    mask of coordinates with ``v < 0`` (``sign(0) = +1``). :math:`C(v)` is ``where(negative, -scale,
    scale)``."""
    v = jnp.asarray(v, jnp.float32)
    scale = jnp.sum(jnp.abs(v)) / jnp.float32(v.shape[0])
    return scale, v < 0


def scaled_sign_bits(dim: int) -> int:
    """The length of a scaled-sign message of ``dim`` coordinates: ``32 + dim`` bits."""
    return 32 + int(dim)


def scaled_sign_coder() -> Coder:
    """The scaled-sign compressor :math:`C(v) = (\\|v\\|_1 / d)\\,\\mathrm{sign}(v)` as a stateless coder.

    ``q`` is a :class:`sidejax.distributions.PointMass` at ``v`` (shape ``[d]``); ``p`` only tells the
    receiver ``d``. The stream is the scale as one IEEE float32 word (32 bits), then one bit per coordinate,
    LSB first (1: ``v_i < 0``, 0: ``v_i >= 0``, so ``sign(0) = +1``): ``32 + d`` bits. The decoder returns
    ``scale * (+1 | -1)``, which is exact (a multiplication by ``±1``), so every receiver of a message
    reconstructs the same float32 vector bit for bit.

    This is a deterministic *biased* compressor, not a sample of ``q``: the decoded vector is :math:`C(v)`,
    not ``v``, and the keys are not used. The decoder flags ``ERR_PARSE`` when ``num_bits != 32 + d``,
    ``ERR_LENGTH`` for a truncated or padded payload, and ``ERR_INPUT`` for a scale that is negative or not
    finite (no encoder writes one).
    """

    def encode(keys, q, p):
        del keys, p
        v = jnp.asarray(q.value, jnp.float32)
        scale, negative = scaled_sign(v)
        head = jax.lax.bitcast_convert_type(scale, jnp.uint32)[None]
        words = jnp.concatenate([head, pack_fixed(negative.astype(jnp.uint32), 1)])
        return Message(words, as_bits(scaled_sign_bits(v.shape[0]))), ScaledSignInfo(
            is_valid(q) & jnp.isfinite(scale), jnp.float32(jnp.nan)
        )

    def decode(shared_key, p, message):
        del shared_key
        dim = dist_dim(p)  # the receiver knows the shapes
        cap = sent_words(scaled_sign_bits(dim))
        words = jnp.asarray(message.payload, jnp.uint32)
        sent = words.shape[0]
        words = jnp.pad(words, (0, max(0, cap - sent)))[:cap]
        words, ok_len = mask_to_length(words, message.num_bits, num_sent_words=sent)
        ok_parse = as_bits(message.num_bits) == scaled_sign_bits(dim)
        scale = jax.lax.bitcast_convert_type(words[0], jnp.float32)
        ok_scale = jnp.isfinite(scale) & (scale >= 0)
        negative = unpack_fixed(words[1:], dim, 1) == 1
        errors = failed_checks(length=ok_len, parse=ok_parse, input=ok_scale)
        return jnp.where(negative, -scale, scale), StreamCheck(errors == 0, errors)

    return stateless_coder(
        encode,
        decode,
        uses_prior=False,
        name="scaled-sign",
        capacity_words=lambda dim: 1 + num_words(dim, 1),
        deterministic=True,
        fixed_bits=scaled_sign_bits,
    )


def topk_count(dim: int, divisor: int) -> int:
    """:math:`K = \\max(1, \\lfloor d / m \\rfloor)`: how many coordinates TopK keeps of ``dim`` with
    ``divisor`` ``m`` (M3: ``m = n`` clients, K = floor(d/n))."""
    return max(1, int(dim) // int(divisor))


def topk_index_bits(dim: int) -> int:
    """The width of one position in a TopK message: ``ceil(log2 dim)`` bits (at least 1)."""
    return max(1, (int(dim) - 1).bit_length())


def topk_bits(dim: int, divisor: int) -> int:
    """The length of a TopK message: ``K (32 + ceil(log2 d))`` bits, ``K = topk_count(dim, divisor)``."""
    return topk_count(dim, divisor) * (32 + topk_index_bits(dim))


def topk(v: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` coordinates of ``v`` of largest magnitude as ``(positions, values)``, positions ascending
    (ties broken towards the lower position, as ``lax.top_k``). ``TopK(v)`` is
    ``zeros(d).at[positions].set(values)``."""
    v = jnp.asarray(v, jnp.float32)
    _, positions = jax.lax.top_k(jnp.abs(v), k)
    positions = jnp.sort(positions)
    return positions, v[positions]


def topk_coder(divisor: int) -> Coder:
    """TopK, :math:`K = \\max(1, \\lfloor d / \\mathrm{divisor} \\rfloor)`, as a stateless deterministic
    coder.

    ``q`` is a :class:`sidejax.distributions.PointMass` at ``v`` (shape ``[d]``); ``p`` only tells the
    receiver ``d``. The stream is the ``K`` kept values as IEEE float32 words, then their positions in
    ascending order, ``ceil(log2 d)`` bits each, LSB first (:func:`topk_bits`). The decoder scatters the
    values into zeros, which is exact, so every receiver reconstructs the sender's ``TopK(v)`` bit for bit. It
    flags ``ERR_PARSE`` when ``num_bits`` is not :func:`topk_bits`, ``ERR_LENGTH`` for a truncated or padded
    payload, and ``ERR_INPUT`` for positions that are not strictly ascending below ``d`` or a value that is
    not finite (no encoder writes them).

    Raises ``ValueError`` if ``divisor`` is not an integer >= 1.
    """
    divisor = check_count(divisor, "divisor", 1)

    def capacity(dim):
        k = topk_count(dim, divisor)
        return k + num_words(k, topk_index_bits(dim))

    def encode(keys, q, p):
        del keys, p
        v = jnp.asarray(q.value, jnp.float32)
        dim = v.shape[0]
        k, width = topk_count(dim, divisor), topk_index_bits(dim)
        positions, values = topk(v, k)
        head = jax.lax.bitcast_convert_type(values, jnp.uint32)
        words = jnp.concatenate([head, pack_fixed(positions.astype(jnp.uint32), width)])
        return Message(words, as_bits(topk_bits(dim, divisor))), Float32Info(
            is_valid(q) & jnp.all(jnp.isfinite(values)), jnp.float32(jnp.nan)
        )

    def decode(shared_key, p, message):
        del shared_key
        dim = dist_dim(p)
        k, width = topk_count(dim, divisor), topk_index_bits(dim)
        cap = capacity(dim)
        words = jnp.asarray(message.payload, jnp.uint32)
        sent = words.shape[0]
        words = jnp.pad(words, (0, max(0, cap - sent)))[:cap]
        words, ok_len = mask_to_length(words, message.num_bits, num_sent_words=sent)
        ok_parse = as_bits(message.num_bits) == topk_bits(dim, divisor)
        values = jax.lax.bitcast_convert_type(words[:k], jnp.float32)
        positions = unpack_fixed(words[k:], k, width).astype(jnp.int32)
        ok_input = (
            jnp.all(positions < dim) & jnp.all(positions[1:] > positions[:-1]) & jnp.all(jnp.isfinite(values))
        )
        errors = failed_checks(length=ok_len, parse=ok_parse, input=ok_input)
        return jnp.zeros(dim, jnp.float32).at[positions].set(values, mode="drop"), StreamCheck(
            errors == 0, errors
        )

    return stateless_coder(
        encode,
        decode,
        uses_prior=False,
        name=f"top-k(d/{divisor})",
        capacity_words=capacity,
        deterministic=True,
        fixed_bits=lambda dim: topk_bits(dim, divisor),
    )
