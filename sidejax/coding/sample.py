"""Sample-then-code coders: the sender draws the sample of ``q`` itself (with its private key) and sends it
with a lossless code. These are the baselines' coders (FedPM, QSGD, SignSGD, QLSD); none of them uses ``p``.

- :func:`fixed_width_coder`: a finite alphabet, ``ceil(log2 |alphabet|)`` bits per coordinate (signs: 1 bit).
- :func:`elias_coder`: QSGD's Elias stream of signed integer levels (gap, sign, level per nonzero;
  :func:`sidejax.coding.lossless.elias_levels_encode`).
- :func:`mask_coder`: binary masks as Golomb-coded run lengths (:func:`sidejax.coding.lossless.mask_encode`).

In every case ``num_bits`` is the length of the stream written, and the decoder parses the stream (it does
not receive the sample any other way).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.bits import as_bits, enumerative_mask_bits
from sidejax.coding.base import (
    Coder,
    Message,
    StreamCheck,
    failed_checks,
    stateless_coder,
)
from sidejax.coding.bitstream import mask_to_length, num_words, pack_fixed, unpack_fixed
from sidejax.coding.lossless import (
    elias_levels_capacity_words,
    elias_levels_decode,
    elias_levels_encode,
    mask_capacity_words,
    mask_decode,
    mask_encode,
)
from sidejax.distributions import dist_dim, is_valid

__all__ = ["SampleInfo", "fixed_width_coder", "elias_coder", "mask_coder"]


class SampleInfo(NamedTuple):
    """Encoder diagnostics of a sample-then-code coder: ``valid`` (``q`` was a valid distribution and the
    sample in the coder's alphabet) and ``ideal_bits``, an ideal length for the sample where one is defined
    (the enumerative bound for masks; NaN otherwise), labelled ideal: the message length is ``num_bits``."""

    valid: jax.Array
    ideal_bits: jax.Array


_NAN = np.float32(np.nan)  # (NumPy: importing sidejax must not start JAX's backend, see jax.distributed)


def _padded(message: Message, capacity: int) -> jax.Array:
    words = jnp.asarray(message.payload, jnp.uint32)
    return jnp.pad(words, (0, max(0, capacity - words.shape[0])))[:capacity] if capacity else words[:0]


def fixed_width_coder(alphabet: tuple[float, ...]) -> Coder:
    """Each coordinate's sample is one symbol of ``alphabet`` (e.g. ``(-1.0, 1.0)`` for signs), sent as its
    index in ``ceil(log2 len(alphabet))`` bits: ``dim * width`` bits in all."""
    if len(alphabet) < 2 or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must hold at least two distinct symbols, got {alphabet!r}")
    symbols = tuple(float(a) for a in sorted(alphabet))
    width = max(1, math.ceil(math.log2(len(symbols))))

    def encode(keys, q, p):
        del p
        x = q.sample(keys.private)
        table = jnp.asarray(symbols, jnp.float32)
        index = jnp.clip(jnp.searchsorted(table, x), 0, len(symbols) - 1)
        ok = is_valid(q) & jnp.all(table[index] == x)
        words = pack_fixed(index.astype(jnp.uint32), width)
        num_bits = as_bits(width * x.shape[0])
        return Message(words, num_bits), SampleInfo(ok, _NAN)

    def decode(shared_key, p, message):
        del shared_key
        dim = dist_dim(p)  # the receiver knows the shapes: p has the vector's length
        cap = -(-dim * width // 32)
        words, ok_len = mask_to_length(_padded(message, cap), message.num_bits, num_sent_words=_n(message))
        index = unpack_fixed(words, dim, width).astype(jnp.int32)
        ok_sym = jnp.all(index < len(symbols))
        ok_parse = as_bits(message.num_bits) == width * dim
        errors = failed_checks(length=ok_len, parse=ok_parse, input=ok_sym)
        x = jnp.asarray(symbols, jnp.float32)[jnp.minimum(index, len(symbols) - 1)]
        return x, StreamCheck(errors == 0, errors)

    return stateless_coder(
        encode,
        decode,
        uses_prior=False,
        name=f"fixed{width}",
        capacity_words=lambda dim: num_words(dim, width),
        deterministic=True,
        fixed_bits=lambda dim: width * int(dim),
    )


def _n(message: Message) -> int:
    return jnp.asarray(message.payload).shape[0]


def _lossless_sample_coder(name: str, encode_sample, decode_stream, capacity_words) -> Coder:
    """A sample-then-code coder whose stream is a lossless code of the sample ``x`` drawn from ``q`` (private
    key): ``encode_sample(x) -> (words, num_bits, in_alphabet, ideal_bits)`` codes it, ``valid`` is
    ``is_valid(q) & in_alphabet``; ``decode_stream(words, num_bits, dim) -> (x, ok)`` reads it back, and a
    stream that does not parse (``ok`` False) is :data:`ERR_PARSE`. Stateless, deterministic, no prior."""

    def encode(keys, q, p):
        del p
        x = q.sample(keys.private)
        words, num_bits, in_alphabet, ideal_bits = encode_sample(x)
        return Message(words, num_bits), SampleInfo(is_valid(q) & in_alphabet, ideal_bits)

    def decode(shared_key, p, message):
        del shared_key
        x, ok = decode_stream(jnp.asarray(message.payload, jnp.uint32), message.num_bits, dist_dim(p))
        errors = failed_checks(parse=ok)
        return x.astype(jnp.float32), StreamCheck(errors == 0, errors)

    return stateless_coder(
        encode, decode, uses_prior=False, name=name, capacity_words=capacity_words, deterministic=True
    )


def elias_coder(max_level: int) -> Coder:
    """QSGD's Elias code (Alistarh et al. 2017, §3.2) of the signed integer levels ``q.sample`` draws in
    ``[-max_level, max_level]``: for each nonzero, the Elias-gamma code of the gap to the previous nonzero,
    a sign bit, and the Elias-gamma code of the level. The gaps run over the whole flat vector (so the
    stream decodes without per-tensor counts); the norms travel as side information
    (:func:`sidejax.coding.with_side_info`)."""
    if max_level < 1:
        raise ValueError(f"max_level must be >= 1, got {max_level}")

    def encode_levels(levels):
        words, num_bits = elias_levels_encode(levels.astype(jnp.int32), max_level=max_level)
        return words, num_bits, jnp.all(jnp.abs(levels) <= max_level), _NAN

    def decode_levels(words, num_bits, dim):
        return elias_levels_decode(words, num_bits, dim=dim, max_level=max_level)

    return _lossless_sample_coder(
        "elias", encode_levels, decode_levels, lambda dim: elias_levels_capacity_words(dim, max_level)
    )


def mask_coder() -> Coder:
    """A binary mask drawn from ``q`` (a :class:`sidejax.distributions.Bernoulli`), sent as Golomb-coded run
    lengths (:func:`sidejax.coding.lossless.mask_encode`): close to :math:`d H_b(k/d)` bits for a mask with
    ``k`` ones, the cost of the arithmetic code FedPM reports."""

    def encode_mask(mask):
        words, num_bits = mask_encode(mask)
        return words, num_bits, jnp.asarray(True), enumerative_mask_bits(mask)

    def decode_mask(words, num_bits, dim):
        return mask_decode(words, num_bits, dim=dim)

    return _lossless_sample_coder("golomb-mask", encode_mask, decode_mask, mask_capacity_words)
