"""Lossless variable-length streams for the baseline coders: QSGD's Elias stream and a Golomb mask stream.

Both formats are written with :func:`sidejax.coding.bitstream.write_codewords` (codewords most-significant
bit first; stream bit ``p`` is bit ``p mod 32`` of word ``p // 32``, the layout of ``pack_fixed``) into a
static-capacity uint32 buffer sized for the worst case, and ``num_bits`` is the exact length of the stream
built (an int32 count as in :class:`sidejax.coding.Message`; capacities are limited to
:data:`MAX_STREAM_BITS` = :math:`2^{28}` bits, which the encoders check). Only the first
``ceil(num_bits / 32)`` words are sent (:func:`sidejax.coding.sent_message` cuts a message at the host
boundary).

Decoding is parallel-friendly. The length of the symbol that would start at *every* bit position is
computed at once (O(capacity) vectorised work: 32-bit windows and count-leading-zeros, plus the first
nonzero word after each position for Golomb's unary part), then the chain of symbol starts from the
beginning to ``num_bits`` is followed by :func:`sidejax.coding.bitstream.codeword_starts`: a sequential
``lax.while_loop`` with an O(1) body bounded by the static maximum symbol count (``"walk"``, the CPU
default), or pointer doubling in O(capacity log symbols) with no data-dependent loop (``"jump"``, the
accelerator default). The symbols are then gathered, cumulated and scattered vectorised. Decoders read
nothing past ``num_bits`` (later bits are masked off, and a set bit there is an error) and return
``ok=False``, with an all-zero output, on a malformed stream.

**QSGD Elias stream** (Alistarh et al., 2017, §3.2) of integer levels :math:`\\ell \\in [-s, s]^d`: for
each nonzero coordinate :math:`i_1 < i_2 < \\dots` in order, :math:`\\gamma(i_j - i_{j-1})` (with
:math:`i_0 = -1`; gaps are global over the flat vector, so the stream needs no per-tensor counts), one sign
bit (1 = negative), and :math:`\\gamma(|\\ell_{i_j}|)`, where :math:`\\gamma` is Elias-gamma
(:math:`2\\lfloor\\log_2 n\\rfloor + 1` bits). The stream ends after the last nonzero; an all-zero vector
is the empty stream.

**Mask stream** for a binary mask of ``d`` coordinates with :math:`k_1` ones. Header: 1 flag bit (0: the
ones are coded; 1: the zeros are, chosen when :math:`2 k_1 > d`) and the Golomb parameter
:math:`m \\in [1, d]` in ``W = d.bit_length()`` bits (:func:`mask_header_bits`). Then, for each coded
position :math:`i_1 < i_2 < \\dots` (``k`` of them, :math:`k \\le d/2`), the Golomb code with parameter
:math:`m` of the run :math:`i_j - i_{j-1} - 1` (:math:`i_0 = -1`). For a Bernoulli mask the runs are
geometric, and the optimal Golomb parameter (Gallager and Van Voorhis, 1975) is

.. math::

    m = \\left\\lceil \\frac{\\log(2 - p)}{-\\log(1 - p)} \\right\\rceil, \\qquad p = k / d

(:func:`optimal_golomb_parameter`, computed inside jit; :math:`m = 1` for :math:`p \\ge (3 - \\sqrt5)/2
\\approx 0.382`, one bit per coordinate up to the last coded one). The ideal two-part enumerative code
takes :math:`\\lceil\\log_2(d+1)\\rceil + \\lceil\\log_2\\binom{d}{k}\\rceil` bits
(:func:`sidejax.algorithms.common.enumerative_mask_bits`); the header here is one bit longer, and the
Golomb code's redundancy on geometric runs is a few hundredths of a bit per coded position. Measured on
Bernoulli masks at d = 61706 (stream / enumerative length): density 0.01: 4976 / 4949 bits (+0.55%),
0.1: +0.86%, 0.3: +0.82%, 0.5: 61722 / 61713 (+0.01%), 0.7: +0.62%, 0.99: +0.48%.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.bits import as_bits
from sidejax.coding.bitstream import (
    INVALID_LENGTH,
    codeword_starts,
    elias_gamma_decode,
    elias_gamma_length,
    golomb_codeword,
    golomb_decode,
    golomb_length,
    mask_to_length,
    prefix_sum,
    read_bits,
    resolve_chain_method,
    write_codewords,
)
from sidejax.utils import is_concrete

__all__ = [
    "MAX_STREAM_BITS",
    "elias_levels_capacity_words",
    "elias_levels_length",
    "elias_levels_encode",
    "elias_levels_decode",
    "optimal_golomb_parameter",
    "mask_header_bits",
    "mask_capacity_words",
    "mask_code_length",
    "mask_encode",
    "mask_decode",
]

MAX_STREAM_BITS = 1 << 28
"""Largest stream capacity (bits) the encoders accept: the decoders work on one int32 per stream bit (a
symbol length at every position), 1 GiB at this size. (Until lengths became int32 the limit was
:math:`2^{24}`, where float32 lengths stop being exact.)"""


def _check_dim(dim, name: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not 1 <= dim < (1 << 30):
        raise ValueError(f"{name} must be an int in [1, 2**30), got {dim!r}")
    return int(dim)


def _check_max_level(max_level) -> int:
    if isinstance(max_level, bool) or not isinstance(max_level, (int, np.integer)):
        raise ValueError(f"max_level must be an int, got {max_level!r}")
    if not 1 <= max_level < (1 << 31):
        raise ValueError(f"max_level must be in [1, 2**31), got {max_level}")
    return int(max_level)


def _check_words(words) -> jax.Array:
    words = jnp.asarray(words)
    if words.ndim != 1 or words.shape[0] < 1:
        raise ValueError(f"words must be a non-empty 1-D word buffer, got shape {words.shape}")
    if words.dtype not in (jnp.uint32, jnp.int32):
        raise ValueError(f"words must be uint32, got {words.dtype}")
    if 32 * words.shape[0] > 4 * MAX_STREAM_BITS:
        raise ValueError(
            f"words holds {32 * words.shape[0]} bits, more than the {4 * MAX_STREAM_BITS} supported"
        )
    return words.astype(jnp.uint32)


def _check_capacity(bits: int, what: str) -> int:
    if bits > MAX_STREAM_BITS:
        raise ValueError(
            f"{what}: worst-case stream of {bits} bits exceeds {MAX_STREAM_BITS} (the decoder's per-bit work "
            "arrays would take over 1 GiB)"
        )
    return max(1, -(-bits // 32))


def _gaps(marked: jax.Array) -> jax.Array:
    """For every marked coordinate ``i``: ``i`` minus the previous marked coordinate (-1 if none); 0 at
    unmarked coordinates. By ranks (one prefix sum, one scatter of the marked coordinates by rank, one
    gather), which is cheaper than a running maximum on CPU."""
    d = marked.shape[0]
    idx = jnp.arange(d, dtype=jnp.int32)
    rank = prefix_sum(marked)  # 1-based rank of each marked coordinate
    by_rank = jnp.full(d + 1, -1, jnp.int32).at[jnp.where(marked, rank, d + 1)].set(idx, mode="drop")
    return jnp.where(marked, idx - by_rank[jnp.maximum(rank - 1, 0)], 0)


def _positions_from_gaps(gaps: jax.Array, live: jax.Array, dim: int):
    """Coordinates :math:`\\sum_{j \\le i} g_j - 1` of the live symbols and whether all lie below ``dim``.

    Gaps are clipped to ``dim + 1``: a prefix sum first reaching ``dim`` or more is caught before any int32
    overflow (``dim < 2**30``), so a later wrap-around cannot hide it.
    """
    g = jnp.where(live, jnp.clip(gaps, 0, dim + 1), 0)
    pos = prefix_sum(g) - 1
    return pos, ~jnp.any(live & (pos >= dim))


# ----------------------------------------------------------------------------------------------------
# QSGD Elias stream


@functools.lru_cache(maxsize=64)
def _elias_capacity_bits(dim: int, max_level: int) -> int:
    """Worst-case stream length over all level vectors.

    With ``k`` nonzeros and gaps :math:`g_j` (:math:`\\sum g_j \\le d`), Jensen gives
    :math:`\\sum_j (2\\lfloor\\log_2 g_j\\rfloor + 1) \\le k (2\\log_2(d/k) + 1)`; each nonzero adds a sign
    bit and at most :math:`\\gamma(s)` bits, so the length is at most
    :math:`f(k) = k (2 \\log_2(d / k) + 2 + |\\gamma(s)|)`, concave in ``k``: its maximum over integers is at
    the floor or ceiling of :math:`k^* = d\\, 2^{(c - 2/\\ln 2)/2}` (clipped to ``[1, d]``).
    """
    c = 2 + 2 * (max_level.bit_length() - 1) + 1
    k_star = dim * 2.0 ** ((c - 2.0 / math.log(2.0)) / 2.0)
    cands = {1, dim, min(max(math.floor(k_star), 1), dim), min(max(math.ceil(k_star), 1), dim)}
    best = max(k * (2.0 * math.log2(dim / k) + c) for k in cands)
    return int(math.floor(best + 1e-6))


def elias_levels_capacity_words(dim: int, max_level: int) -> int:
    """Static word capacity of the QSGD Elias stream of ``dim`` levels in ``[-max_level, max_level]``.

    Raises ``ValueError`` if the worst case exceeds :data:`MAX_STREAM_BITS`.
    """
    dim, max_level = _check_dim(dim), _check_max_level(max_level)
    return _check_capacity(_elias_capacity_bits(dim, max_level), "elias_levels")


def _check_levels(levels, max_level: int) -> jax.Array:
    levels = jnp.asarray(levels)
    if levels.ndim != 1 or not jnp.issubdtype(levels.dtype, jnp.integer):
        raise ValueError(f"levels must be a 1-D integer array, got shape {levels.shape} dtype {levels.dtype}")
    _check_dim(levels.shape[0], "levels length")
    if is_concrete(levels):
        worst = int(np.max(np.abs(np.asarray(levels, np.int64)), initial=0))
        if worst > max_level:
            raise ValueError(
                f"levels must lie in [-max_level, max_level] = [-{max_level}, {max_level}]: got |{worst}|"
            )
    return levels.astype(jnp.int32)


def _elias_symbols(levels: jax.Array):
    nz = levels != 0
    return nz, _gaps(nz), levels < 0, jnp.abs(levels)


def elias_levels_length(levels: jax.Array) -> jax.Array:
    """Exact length of the QSGD Elias stream of ``levels[d]``, from the symbols:
    :math:`\\sum_{i: \\ell_i \\ne 0} \\big(|\\gamma(g_i)| + 1 + |\\gamma(|\\ell_i|)|\\big)` (int32)."""
    levels = jnp.asarray(levels)
    if levels.ndim != 1 or not jnp.issubdtype(levels.dtype, jnp.integer):
        raise ValueError(f"levels must be a 1-D integer array, got shape {levels.shape} dtype {levels.dtype}")
    nz, gap, _, mag = _elias_symbols(levels.astype(jnp.int32))
    per = elias_gamma_length(gap) + 1 + elias_gamma_length(mag)
    return as_bits(jnp.sum(jnp.where(nz, per, 0)))


def elias_levels_encode(levels: jax.Array, *, max_level: int):
    """Encodes integer levels ``levels[d]`` in ``[-max_level, max_level]`` as QSGD's Elias stream.

    Each nonzero is written as two codewords: :math:`\\gamma(g)` followed by the sign bit, which is ``2g +
    sign`` zero-extended to :math:`|\\gamma(g)| + 1` bits, and :math:`\\gamma(|\\ell|)`.

    Args:
      levels: int ``[d]``.
      max_level: static bound ``s`` on ``|levels|`` (sizes the buffer; checked when ``levels`` is concrete).

    Returns:
      ``(words, num_bits)``: uint32 ``[elias_levels_capacity_words(d, s)]`` (zero past the stream) and the
      exact stream length (int32).
    """
    max_level = _check_max_level(max_level)
    levels = _check_levels(levels, max_level)
    cap = elias_levels_capacity_words(levels.shape[0], max_level)
    nz, gap, neg, mag = _elias_symbols(levels)
    first = (gap.astype(jnp.uint32) << 1) | neg.astype(jnp.uint32)
    len1 = jnp.where(nz, elias_gamma_length(gap) + 1, 0)
    len2 = jnp.where(nz, elias_gamma_length(mag), 0)
    values = jnp.stack([first, mag.astype(jnp.uint32)], axis=1)
    lengths = jnp.stack([len1, len2], axis=1)
    words, end = write_codewords(values, lengths, capacity_words=cap)
    return words, as_bits(end)


def elias_levels_decode(words: jax.Array, num_bits, *, dim: int, max_level: int, method: str | None = None):
    """Decodes a QSGD Elias stream (inverse of :func:`elias_levels_encode`, bit exact).

    For every stream position ``p`` the symbol that would start there is decoded at once: gap
    :math:`\\gamma` at ``p``, the sign bit after it, level :math:`\\gamma` after that; a symbol is invalid
    when a codeword has 32 or more leading zeros, the gap exceeds ``dim`` or the level lies outside
    ``[1, max_level]``. The chain of symbol starts from 0 to ``num_bits`` is then walked (at most ``dim``
    symbols).

    Detected (``ok=False``, levels all zero): ``num_bits`` not a whole number in ``[0, 32 len(words)]``,
    set bits past ``num_bits``, a symbol overrunning ``num_bits`` (truncation in mid-symbol), invalid codes,
    a coordinate past ``dim``. Not detectable: corruptions that still parse as a valid stream (e.g. a flipped
    sign bit, or a cut exactly at a symbol boundary), as with any code without redundancy.

    Args:
      words: uint32 ``[n]`` buffer (the capacity buffer or the trimmed payload).
      num_bits: stream length (float or int scalar, may be traced).
      dim: static number of coordinates ``d``.
      max_level: static level bound ``s``.
      method: how the chain of symbol starts is followed: ``"walk"`` (sequential ``while_loop``),
        ``"jump"`` (pointer doubling) or ``None`` (walk on CPU, jump on accelerators); see
        :func:`sidejax.coding.bitstream.codeword_starts`.

    Returns:
      ``(levels, ok)``: int32 ``[d]`` and a bool scalar.
    """
    dim, max_level = _check_dim(dim), _check_max_level(max_level)
    method = resolve_chain_method(method)
    words, ok_len = mask_to_length(_check_words(words), num_bits)
    cap = 32 * words.shape[0]
    p = jnp.arange(cap, dtype=jnp.int32)
    n_at, len_at, _ = elias_gamma_decode(words)  # the gap (or level) codeword at every position

    def at(table, q, fill):
        return jnp.where(q < cap, table[jnp.clip(q, 0, cap - 1)], fill)

    gap_len = len_at
    lev_pos = p + gap_len + 1
    lev = at(n_at, lev_pos, jnp.uint32(0))
    lev_len = at(len_at, lev_pos, INVALID_LENGTH)
    valid = (
        (gap_len < INVALID_LENGTH)
        & (lev_len < INVALID_LENGTH)
        & (n_at <= jnp.uint32(dim))
        & (lev >= 1)
        & (lev <= jnp.uint32(max_level))
    )
    sym_len = jnp.where(valid, gap_len + 1 + lev_len, INVALID_LENGTH)
    starts, count, ok_walk = codeword_starts(sym_len, num_bits, max_symbols=dim, method=method)

    live = jnp.arange(starts.shape[0]) < count
    pos, ok_pos = _positions_from_gaps(n_at[starts].astype(jnp.int32), live, dim)
    sign = read_bits(words, starts + gap_len[starts], 1)
    signed = jnp.where(sign == 1, -1, 1) * lev[starts].astype(jnp.int32)
    ok = ok_len & ok_walk & ok_pos
    out = jnp.zeros(dim, jnp.int32).at[jnp.where(live & ok, pos, dim)].set(signed, mode="drop")
    return out, ok


# ----------------------------------------------------------------------------------------------------
# Binary mask stream


def optimal_golomb_parameter(count, dim: int) -> jax.Array:
    """Golomb parameter for ``count`` coded positions out of ``dim`` (inside jit).

    :math:`m = \\lceil \\log(2 - p) / (-\\log(1 - p)) \\rceil` with :math:`p = \\text{count}/\\text{dim}`,
    the optimal parameter for geometric run lengths of success probability ``p`` (Gallager and Van Voorhis,
    1975); 1 when ``count`` is 0, clipped to ``[1, dim]``. int32 scalar (float32 arithmetic).
    """
    dim = _check_dim(dim)
    k = jnp.asarray(count, jnp.float32)
    p = jnp.clip(k / dim, 1.0 / dim, 1.0 - 1.0 / (2.0 * dim))
    m = jnp.ceil(jnp.log(2.0 - p) / -jnp.log1p(-p))
    m = jnp.where(k > 0, m, 1.0)
    return jnp.clip(m, 1, dim).astype(jnp.int32)


def mask_header_bits(dim: int) -> int:
    """Header length of the mask stream: 1 flag bit plus the Golomb parameter in ``dim.bit_length()``
    bits."""
    return 1 + _check_dim(dim).bit_length()


def _ceil_log2(m: np.ndarray) -> np.ndarray:
    """``ceil(log2 m)`` of integers ``m >= 1`` (the bit length of ``m - 1``, exact via ``frexp``)."""
    return np.frexp((m - 1).astype(np.float64))[1].astype(np.int64)


@functools.lru_cache(maxsize=64)
def _mask_capacity_bits(dim: int) -> int:
    """Worst-case mask stream length over all masks, computed on the host.

    For ``k`` coded positions and parameter ``m``, with :math:`r_j = g_j - 1` and
    :math:`\\sum_j r_j \\le d - k`:
    :math:`\\sum_j \\lfloor r_j/m \\rfloor \\le \\lfloor (d-k)/m \\rfloor`, and each codeword has 1
    terminating bit and at most :math:`\\lceil\\log_2 m\\rceil` remainder bits. The maximum runs over
    ``k = 0..d/2`` and, for each ``k``, over the parameters :func:`optimal_golomb_parameter` can return:
    the ceiling of the float64 ratio perturbed by a relative :math:`10^{-4}` either way (the in-jit float32
    ratio is within a few ulps, so it can only differ where the ratio is that close to an integer).
    """
    k = np.arange(dim // 2 + 1, dtype=np.int64)
    p = np.clip(k / dim, 1.0 / dim, 1.0 - 1.0 / (2.0 * dim))
    ratio = np.log(2.0 - p) / -np.log1p(-p)
    best = 0
    for scale in (1.0 - 1e-4, 1.0 + 1e-4):
        m = np.clip(np.where(k > 0, np.ceil(ratio * scale), 1.0), 1, dim).astype(np.int64)
        best = max(best, int(np.max((dim - k) // m + k * (1 + _ceil_log2(m)))))
    return mask_header_bits(dim) + best


def mask_capacity_words(dim: int) -> int:
    """Static word capacity of the mask stream of ``dim`` coordinates (raises ``ValueError`` beyond
    :data:`MAX_STREAM_BITS`)."""
    return _check_capacity(_mask_capacity_bits(_check_dim(dim)), "mask")


def _check_mask(mask) -> jax.Array:
    mask = jnp.asarray(mask)
    if mask.ndim != 1:
        raise ValueError(f"mask must be 1-D, got shape {mask.shape}")
    _check_dim(mask.shape[0], "mask length")
    if is_concrete(mask):
        m = np.asarray(mask)
        if not np.all((m == 0) | (m == 1)):
            raise ValueError("mask must hold only 0 and 1")
    return mask != 0


def _mask_symbols(mask: jax.Array):
    d = mask.shape[0]
    ones = jnp.sum(mask, dtype=jnp.int32)
    flag = 2 * ones > d
    coded = mask ^ flag
    k = jnp.where(flag, d - ones, ones)
    m = optimal_golomb_parameter(k, d)
    return flag, coded, m, jnp.maximum(_gaps(coded) - 1, 0)


def mask_code_length(mask: jax.Array) -> jax.Array:
    """Exact length of the mask stream of ``mask[d]`` (0/1), from the symbols: the header plus
    :math:`\\sum_j (\\lfloor r_j/m\\rfloor + 1 + \\text{remainder length})` over the coded positions
    (int32)."""
    mask = _check_mask(mask)
    _, coded, m, run = _mask_symbols(mask)
    body = jnp.sum(jnp.where(coded, golomb_length(run, m), 0))
    return as_bits(mask_header_bits(mask.shape[0]) + body)


def mask_encode(mask: jax.Array):
    """Encodes a binary ``mask[d]`` (values 0/1, any dtype; a traced nonzero counts as 1) as the Golomb mask
    stream.

    Returns:
      ``(words, num_bits)``: uint32 ``[mask_capacity_words(d)]`` and the exact stream length (int32).
    """
    mask = _check_mask(mask)
    d = mask.shape[0]
    cap = mask_capacity_words(d)
    width = d.bit_length()
    flag, coded, m, run = _mask_symbols(mask)
    val, length = golomb_codeword(run, m, bound=d + 1)
    header = (flag.astype(jnp.uint32) << width) | m.astype(jnp.uint32)
    values = jnp.concatenate([header[None], val])
    lengths = jnp.concatenate([jnp.array([1 + width], jnp.int32), jnp.where(coded, length, 0)])
    words, end = write_codewords(values, lengths, capacity_words=cap)
    return words, as_bits(end)


def mask_decode(words: jax.Array, num_bits, *, dim: int, method: str | None = None):
    """Decodes a mask stream (inverse of :func:`mask_encode`, bit exact).

    Detected (``ok=False``, mask all zero): ``num_bits`` not a whole number in ``[0, 32 len(words)]`` or
    shorter than the header, set bits past ``num_bits``, a parameter outside ``[1, d]``, a codeword
    overrunning ``num_bits`` (truncation in mid-codeword), a position past ``d``, and more coded positions
    than the flag allows (``d // 2`` ones, ``(d - 1) // 2`` zeros). Not detectable: corruptions that still
    parse (a changed remainder, a cut at a codeword boundary, a flipped flag bit with few coded positions).

    Args:
      words: uint32 ``[n]`` buffer.
      num_bits: stream length (may be traced).
      dim: static mask length ``d``.
      method: ``"walk"``, ``"jump"`` or ``None``, as in :func:`elias_levels_decode`.

    Returns:
      ``(mask, ok)``: float32 ``[d]`` of 0/1 and a bool scalar.
    """
    dim = _check_dim(dim)
    method = resolve_chain_method(method)
    words, ok_len = mask_to_length(_check_words(words), num_bits)
    width = dim.bit_length()
    head = 1 + width
    flag = read_bits(words, 0, 1) == 1
    m = read_bits(words, 1, width).astype(jnp.int32)
    nb = as_bits(num_bits)
    ok_head = (nb >= head) & (m >= 1) & (m <= dim)
    m = jnp.clip(m, 1, dim)

    runs, len_at, _ = golomb_decode(words, None, m)
    starts, count, ok_walk = codeword_starts(
        len_at, num_bits, max_symbols=dim // 2, start=head, method=method
    )
    live = jnp.arange(starts.shape[0]) < count
    pos, ok_pos = _positions_from_gaps(jnp.minimum(runs[starts], dim) + 1, live, dim)
    ok_count = count <= jnp.where(flag, (dim - 1) // 2, dim // 2)
    ok = ok_len & ok_head & ok_walk & ok_pos & ok_count
    coded = jnp.zeros(dim, jnp.bool_).at[jnp.where(live & ok, pos, dim)].set(True, mode="drop")
    return jnp.where(ok, (coded ^ flag).astype(jnp.float32), 0.0), ok
