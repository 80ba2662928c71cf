"""Deterministic compressors of a vector, as coders: the non-stochastic baselines' messages.

:func:`scaled_sign_coder` sends the scaled sign (Karimireddy et al. 2019, "EF-SignSGD"; the compressor of
every non-stochastic baseline of the BICompFL paper, docs/papers/bicompfl.md#s4-1)

.. math::

    C(v) = \\frac{\\|v\\|_1}{d}\\, \\mathrm{sign}(v), \\qquad \\mathrm{sign}(0) = +1,

as one float32 scale followed by ``d`` sign bits: ``32 + d`` bits for a vector of ``d`` coordinates.

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
    Message,
    StreamCheck,
    failed_checks,
    stateless_coder,
)
from sidejax.coding.bitstream import mask_to_length, num_words, pack_fixed, sent_words, unpack_fixed
from sidejax.distributions import dist_dim, is_valid

__all__ = ["ScaledSignInfo", "scaled_sign", "scaled_sign_bits", "scaled_sign_coder"]


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
