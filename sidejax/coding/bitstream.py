"""Packing fixed-width integer fields into a ``uint32`` bitstream, inside jit.

A packed message is a static-capacity word buffer plus a bit length: the first ``num_bits`` bits are the
message, and the tail of the buffer (capacity for the static maximum number of fields) is not sent. Field
``i`` occupies bits ``[i w, (i + 1) w)``, least-significant bit first within little-endian words. Widths
are 1..32 bits. Unpacking is the exact inverse (tested bit for bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "num_words",
    "sent_words",
    "pack_fixed",
    "unpack_fixed",
    "check_stream",
    "mask_to_length",
    "trim_payload",
    "crc32_words",
]


def num_words(num_fields: int, width: int) -> int:
    """Words needed for ``num_fields`` fields of ``width`` bits."""
    return -(-num_fields * width // 32)


def sent_words(num_bits) -> int:
    """Host side: the number of words a stream of ``num_bits`` bits occupies on the wire,
    ``ceil(num_bits / 32)``. Raises ``ValueError`` if ``num_bits`` is not a whole number >= 0."""
    nb = float(num_bits)
    if not (nb >= 0 and nb == int(nb)):
        raise ValueError(f"num_bits must be a whole number of bits >= 0, got {nb}")
    return -(-int(nb) // 32)


def trim_payload(words, num_bits):
    """Host side: the words actually sent, ``words[:ceil(num_bits / 32)]``, from a static-capacity buffer.

    Raises ``ValueError`` if the buffer is shorter than ``num_bits`` claims or holds set bits past
    ``num_bits`` (bits the sender never counted).
    """
    n = sent_words(num_bits)
    if words.shape[-1] < n:
        raise ValueError(
            f"payload has {words.shape[-1]} words but num_bits={float(num_bits):.0f} needs "
            f"ceil(num_bits / 32) = {n}: the stream is truncated"
        )
    _, ok = mask_to_length(words, num_bits)
    if not bool(ok):
        raise ValueError(
            f"payload holds set bits past num_bits={float(num_bits):.0f} (not counted in the length)"
        )
    return words[..., :n]


def mask_to_length(words: jax.Array, num_bits, *, num_sent_words: int | None = None):
    """The first ``num_bits`` bits of ``words`` (later bits zeroed) and whether the stream is well formed.

    Inside jit a message travels in a static-capacity buffer; only its first ``ceil(num_bits / 32)`` words are
    sent, and the receiver must read nothing else. ``ok`` is False when ``num_bits`` is not a whole number
    in ``[0, 32 * num_sent_words]`` (``num_sent_words`` defaults to ``len(words)``: a payload shorter than
    ``num_bits`` claims) or when a bit at position ``>= num_bits`` is set (the buffer holds more than was
    counted).

    Returns:
      ``(masked_words, ok)``.
    """
    n = words.shape[0]
    have = n if num_sent_words is None else num_sent_words
    nb = jnp.asarray(num_bits, jnp.float32)
    ok = (nb >= 0) & (nb == jnp.floor(nb)) & (nb <= 32.0 * have)
    nbi = jnp.clip(nb, 0, 32.0 * n).astype(jnp.int32)
    keep = jnp.clip(nbi - 32 * jnp.arange(n, dtype=jnp.int32), 0, 32)  # bits of each word inside the stream
    mask = jnp.where(
        keep >= 32,
        jnp.uint32(0xFFFFFFFF),
        (jnp.uint32(1) << jnp.minimum(keep, 31).astype(jnp.uint32)) - jnp.uint32(1),
    )
    masked = words.astype(jnp.uint32) & mask
    return masked, ok & jnp.all(masked == words)


def _check_width(width: int) -> None:
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in 1..32 bits, got {width}")


def pack_fixed(values: jax.Array, width: int, *, bit_offset=0, out: jax.Array | None = None) -> jax.Array:
    """Packs ``values`` (nonnegative ints ``< 2**width``, static length L) into ``num_words(L, width)`` words.

    Bits above ``width`` in a value are masked off (callers guarantee the range).

    With ``out`` (a word buffer) the fields are added into it starting at bit ``bit_offset`` (may be traced),
    which concatenates several fields into one stream. The target bits of ``out`` must be zero, and fields
    that fall past the end of ``out`` are dropped.
    """
    _check_width(width)
    n = values.shape[0]
    v = values.astype(jnp.uint32)
    if width < 32:
        v = v & jnp.uint32((1 << width) - 1)
    offset = jnp.asarray(bit_offset, jnp.uint32) + jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(width)
    word = (offset >> 5).astype(jnp.int32)
    shift = offset & jnp.uint32(31)
    lo = v << shift
    spill = (shift + jnp.uint32(width)) > 32
    hi = jnp.where(spill, v >> jnp.where(spill, jnp.uint32(32) - shift, jnp.uint32(0)), jnp.uint32(0))
    if out is None:
        out = jnp.zeros(num_words(n, width), jnp.uint32)
    # fields occupy disjoint bits, so adding is the same as OR-ing
    out = out.at[word].add(lo, mode="drop")
    return out.at[word + 1].add(hi, mode="drop")


def unpack_fixed(words: jax.Array, num_fields: int, width: int, *, bit_offset=0) -> jax.Array:
    """Inverse of :func:`pack_fixed`: ``num_fields`` fields as ``uint32``, starting at bit ``bit_offset``.

    With the default offset 0 a buffer too short for the fields raises ``ValueError``; with a (traced)
    offset, fields past the end of the buffer read as 0.
    """
    _check_width(width)
    need = num_words(num_fields, width)
    if isinstance(bit_offset, int) and bit_offset == 0 and words.shape[0] < need:
        raise ValueError(
            f"truncated bitstream: {num_fields} fields of {width} bits need {need} words, "
            f"got {words.shape[0]}"
        )
    offset = jnp.asarray(bit_offset, jnp.uint32) + jnp.arange(num_fields, dtype=jnp.uint32) * jnp.uint32(
        width
    )
    word = (offset >> 5).astype(jnp.int32)
    shift = offset & jnp.uint32(31)
    inside = word < words.shape[0]
    lo = jnp.where(inside, words[jnp.minimum(word, words.shape[0] - 1)], jnp.uint32(0)) >> shift
    spill = (shift + jnp.uint32(width)) > 32
    nxt = jnp.where(spill & (word + 1 < words.shape[0]), words[jnp.minimum(word + 1, words.shape[0] - 1)], 0)
    nxt = nxt.astype(jnp.uint32)
    hi = jnp.where(spill, nxt << jnp.where(spill, jnp.uint32(32) - shift, jnp.uint32(0)), jnp.uint32(0))
    v = lo | hi
    if width < 32:
        v = v & jnp.uint32((1 << width) - 1)
    return v


def check_stream(num_bits, expected_bits, *, what: str = "message") -> None:
    """Host-side check that a received stream has the expected length; raises ``ValueError`` if not.

    Use it on concrete messages before decoding (inside jit lengths are traced and cannot raise).
    """
    got, want = float(num_bits), float(expected_bits)
    if got != want:
        kind = "truncated" if got < want else "corrupted (too long)"
        raise ValueError(f"{what} is {kind}: {got:.0f} bits, expected {want:.0f}")


# ----------------------------------------------------------------------------------------------------
# CRC-32 (IEEE 802.3 / zlib) of a word stream, vectorised
#
# The reflected CRC register steps one word at a time as c <- (c xor w) * x^32 mod G (bit i of a register
# is the coefficient of x^(31-i), G = 0xEDB88320 reflected), so for words w_0..w_{n-1}
#
#     c_n = c_0 x^(32 n)  xor  XOR_k w_k x^(32 (n - k))   (mod G; c_0 = 0xFFFFFFFF; output c_n xor 0xFFFFFFFF)
#
# Every term is one carry-less multiply-mod by a power of x^32 from a host-computed table, so the whole
# CRC is elementwise work plus one XOR reduction, with a traced length n (no sequential scan over bytes).

_CRC_POLY = 0xEDB88320
_CRC_ONE = 0x80000000  # the polynomial 1 in the reflected representation


@functools.lru_cache(maxsize=16)
def _x32_powers(n: int) -> np.ndarray:
    """``P[m] = x^(32 m) mod G`` for ``m = 0..n`` (reflected), by doubling: ``P[2^j + i] = P[i] P[2^j]``."""
    out = np.empty(n + 1, np.uint32)
    out[0] = _CRC_ONE
    x32 = _mulmod(np.uint32(_CRC_ONE), np.uint32(1), np)  # x^31 is bit 0; x^32 = x^31 * x
    x32 = (x32 >> np.uint32(1)) ^ (np.uint32(_CRC_POLY) if x32 & 1 else np.uint32(0))
    if n >= 1:
        out[1] = x32
    filled = min(2, n + 1)
    while filled < n + 1:  # out[:filled] known; x^(32 filled) = out[filled - 1] * out[1]
        step = _mulmod(out[filled - 1], out[1], np)
        take = min(filled, n + 1 - filled)
        out[filled : filled + take] = _mulmod(out[:take], step, np)
        filled += take
    return out


def _mulmod(a, b, xp=jnp):
    """Carry-less product mod G of reflected 32-bit polynomials, elementwise (32 shift/xor steps); ``xp`` is
    ``jnp`` inside the CRC and ``np`` for the host-side table of powers."""
    p = xp.zeros(np.broadcast_shapes(np.shape(a), np.shape(b)), xp.uint32)
    a = xp.asarray(a, xp.uint32)
    b = xp.broadcast_to(xp.asarray(b, xp.uint32), p.shape)
    one, poly = xp.uint32(1), xp.uint32(_CRC_POLY)
    for i in range(32):
        p = p ^ xp.where((a >> xp.uint32(31 - i)) & one == one, b, xp.uint32(0))
        b = (b >> one) ^ xp.where(b & one == one, poly, xp.uint32(0))
    return p


def crc32_words(words: jax.Array, num_words=None) -> jax.Array:
    """CRC-32 (zlib's ``crc32``) of the little-endian bytes of ``words[:num_words]``, inside jit.

    Args:
      words: uint32 ``[n]`` buffer.
      num_words: how many leading words the checksum covers (may be traced; default all).

    Returns:
      uint32 scalar, equal to ``zlib.crc32(words[:num_words].astype('<u4').tobytes())``.
    """
    cap = words.shape[0]
    n = jnp.asarray(cap if num_words is None else num_words, jnp.int32)
    table = jnp.asarray(_x32_powers(cap))
    k = jnp.arange(cap, dtype=jnp.int32)
    w = jnp.where(k < n, words.astype(jnp.uint32), jnp.uint32(0))
    terms = _mulmod(w, table[jnp.clip(n - k, 0, cap)])
    acc = jax.lax.reduce(terms, np.uint32(0), jax.lax.bitwise_xor, (0,))
    acc = acc ^ _mulmod(jnp.uint32(0xFFFFFFFF), table[jnp.clip(n, 0, cap)])
    return acc ^ jnp.uint32(0xFFFFFFFF)
