"""Adaptive-Avg KLMS: equal-sized blocks whose one size adapts to the clients' average KL (BICompFL App. C).

BICompFL (docs/papers/bicompfl.md#s3-8 "Adaptive-Avg", docs/papers/bicompfl.md#s8-8) replaces Adaptive-KLMS's
per-block partition by equal-sized blocks of one size :math:`b_t`: blocks
:math:`I_m = [m b_t, \\min((m+1) b_t, d))`, :math:`m < M_t = \\lceil d / b_t \\rceil` (the last one shorter),
one importance-sampling index of :math:`K^* = \\log_2 n_{IS}` bits per block. Only the size is ever
communicated, in :math:`L = \\log_2 b_{max}` bits, instead of :math:`M \\log_2 b_{max}` bits of block lengths.

**Protocol** (the [A] resolution of the paper's prose, docs/papers/bicompfl.md#s3-8). The server holds
:math:`b_t`, a flag ``update`` and a flag ``changed``; every receiver holds a copy, kept current by the
downlink.

- Every round, client :math:`i` encodes one index per block of size :math:`b_t` and a 1-bit *request*: set
  when its mean KL per block :math:`\\bar D_i = D_{KL}(q_i \\| p) / M_t` (bits) is off the target by more
  than the trigger factor :math:`f`, i.e. :math:`\\bar D_i / K^* \\notin [1/f, f]`.
- In an *update round* (``update`` set) it also proposes
  :math:`b_i = \\mathrm{clip}(\\mathrm{round}(K^* / \\bar k_i), 1, b_{max})` with
  :math:`\\bar k_i = D_{KL}(q_i \\| p) / d` its mean KL per parameter in bits (so a block of :math:`b_i`
  parameters holds about :math:`K^*` bits of KL), sent as :math:`b_i - 1` in :math:`L` bits. The round
  itself is still encoded with the old size :math:`b_t`.
- Server: after an ordinary round it sets ``update`` for the next round iff *any* participant requested it.
  After an update round it sets :math:`b_{t+1} = \\mathrm{round}(\\frac1n \\sum_i b_i)` (the participants'
  mean, exact integer arithmetic) and clears ``update``: the requests of an update round were measured
  against the size being replaced, so they are ignored. So a request in round :math:`t` makes round
  :math:`t + 1` an update round and the new size applies from round :math:`t + 2`.

``round`` is round-half-to-even throughout (``jnp.round`` and the integer mean). A state with
``KLMSAvgConfig(initial_update=True)`` starts with an update round (the size :math:`b_0` is then used in
rounds 0 and 1 only); the default starts with :math:`b_0` and adapts on the first request.

**Uplink stream** (one ``uint32`` buffer per client, LSB first; :mod:`sidejax.coding.bitstream`):

====================  ===========================================  ========================
field                 width                                        present
====================  ===========================================  ========================
indices               :math:`M_t K^*`                              always
request               1                                            always
proposed size - 1     :math:`L = \\log_2 b_{max}`                  update rounds
CRC-32                32                                           ``config.crc32``
====================  ===========================================  ========================

``num_bits`` is exactly the sum of the present fields, :math:`M_t K^* + 1 + L \\cdot [update] + 32 \\cdot
[crc32]`, and every term is known to the receiver from the protocol state, so the stream is
self-delimiting (:func:`klms_avg_frame`) and several can be relayed back to back
(:func:`sidejax.coding.concat_stacked` / :func:`sidejax.coding.split_stacked`; BICompFL-GR).

**Downlink stream** (:func:`klms_avg_downlink`): the ``update`` flag (1 bit), then, after an update round
(``changed``), the new size minus one (:math:`L` bits), whether or not it differs from the old one: the
receivers know that it is there from the flag they received the round before. So an update costs
:math:`L` bits uplink per participant and :math:`L` bits downlink per receiver, plus one flag bit per
message every round (docs/papers/bicompfl.md#s3-8, all overhead charged).

**Encoder memory.** The block size is dynamic (a traced int), so the number of blocks :math:`M_t` ranges over
:math:`[\\lceil d / b_{max} \\rceil, d]`; a ``[blocks, K]`` log-weight accumulator sized to the static bound
would be :math:`d K` floats (2 GiB at :math:`d = 2 \\cdot 10^6`, :math:`K = 256`). Static buckets picked by
``lax.switch`` do not help: XLA assigns one buffer for all of a conditional's branches, sized to the largest
(measured on :func:`sidejax.coding.klms.klms_encode`, ``dim`` = 61,706, K = 256: 316 MiB of temporaries with
buckets, 317 MiB without, 66 MiB for a program of the smallest bucket alone). :func:`equal_blocks_encode`
therefore streams: a ``lax.scan`` over coordinate chunks of static size :math:`C` accumulates the log-weights
of the blocks the chunk touches (at most :math:`C` rows), selects the index of every block that ends inside
the chunk, and carries the partial log-weights of the one block that continues into the next chunk. Its
working set is :math:`O(K C + d)` for *every* block size; :math:`C` comes from ``memory_budget_bytes``
(measured at :math:`d = 2 \\cdot 10^6`, :math:`K = 256`: 103 MiB of compiled temporaries with the default
256 MiB budget). The rows per chunk are a static bucket (:func:`row_buckets`) picked by ``lax.switch`` from
the block size: here the shared allocation is the largest bucket, ``[C, K]``, the chunk's working set
anyway, and the bucket only saves the per-row work (with blocks of 256 the encoder then runs as fast as
:func:`sidejax.coding.importance.encode_bounded` on the same partition).

**Index choice.** Each block's index is drawn from :math:`\\pi_m(k) \\propto \\prod_{j \\in I_m}
q_j(y_{k,j}) / p_j(y_{k,j})` by inversion with one private uniform per block,
:math:`k^*_m = \\min\\{k : \\sum_{k' \\le k} w_{k'} \\ge u_m \\sum_{k'} w_{k'}\\}`, :math:`w = \\exp(\\log w -
\\max \\log w)`, :math:`u_m` = :func:`sidejax.coding.candidate_uniforms` of the *private* key at
``(m, 0)`` (counter-based, so independent of the chunking; one hash per block instead of KLMS's :math:`K`
Gumbel draws). The candidates are the shared counter-based ones of :mod:`sidejax.coding.importance`, so
:func:`sidejax.coding.importance_decode` regenerates the chosen ones. A block whose candidates all have
``q = 0`` gets a uniform index and is counted (``num_fallback_blocks``).

**Length and integrity** as in :func:`sidejax.coding.klms.klms_decode`, the same inside ``jit`` and
outside it: the payload is the capacity buffer or exactly the ``ceil(num_bits / 32)`` words sent, and a
length mismatch, fields that do not add up to ``num_bits``, an invalid prior or a CRC mismatch set bits of
:attr:`KLMSAvgDecoded.errors` (:func:`sidejax.coding.check_decoded` raises on them on the host).
``KLMSAvgConfig(crc32=True)`` appends the CRC-32 of (shared key data, stream) of :mod:`sidejax.coding.klms`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax.bits import as_bits
from sidejax.blocks import Blocks
from sidejax.coding.base import (
    Coder,
    Message,
    configured_coder,
    failed_checks,
    kl_ideal_bits,
    stream_crc,
)
from sidejax.coding.bitstream import (
    mask_to_length,
    num_words,
    pack_fixed,
    received_words,
    unpack_fixed,
)
from sidejax.coding.importance import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    _check_chunk_size,
    _pad,
    _slice,
    candidate_uniforms,
    candidate_values,
    choose_chunk_size,
    chunk_uniforms,
    importance_decode,
)
from sidejax.distributions import check_dims, dist_dim, is_valid
from sidejax.keys import ClientKeys
from sidejax.utils import keep_unless_none

__all__ = [
    "KLMSAvgConfig",
    "KLMSAvgState",
    "KLMSAvgClientInfo",
    "KLMSAvgDecoded",
    "KLMSAvgServerInfo",
    "equal_blocks",
    "equal_blocks_encode",
    "row_buckets",
    "klms_avg_init",
    "klms_avg_encode",
    "klms_avg_decode",
    "klms_avg_server_update",
    "klms_avg_downlink",
    "klms_avg_receive",
    "klms_avg_frame",
    "klms_avg_coder",
]

# [C, K] float arrays alive at once in a chunk step beyond importance.py's estimate for the candidates and
# log-weights: the block rows' log-weights, their exponentials, cumulative sums and the comparison
_SELECT_ARRAYS = 4
_CANDIDATE_ARRAYS = 10  # importance.py's _ARRAYS_PER_CHUNK (the budget it divides by)
_MAX_LOG2_BLOCK = 24
_ROW_BUCKET_FACTOR = 8


@dataclasses.dataclass(frozen=True)
class KLMSAvgConfig:
    """Static settings of the Adaptive-Avg coder (hashable: closed over by jitted functions).

    Attributes:
      log2_num_candidates: :math:`K^* = \\log_2 n_{IS}`, the bits per block and the target KL per block
        (docs/papers/bicompfl.md#s3-8 [A]: 8, so 256 candidates).
      block_size: the initial block size :math:`b_0` (docs/papers/bicompfl.md#s3-8 [A]: 256),
        ``1 <= b_0 <= max_block_size``.
      max_block_size: :math:`b_{max}`, a power of two ``>= 2`` (docs/papers/bicompfl.md#s3-8 [A]: 2048); a
        size travels as ``size - 1`` in ``log2(max_block_size)`` bits.
      trigger_factor: :math:`f > 1`: a client requests an update when its mean KL per block divided by
        :math:`K^*` leaves :math:`[1/f, f]` (docs/papers/bicompfl.md#s3-8 [A]: 3).
      initial_update: the first round is an update round (default False: start with ``block_size``).
      memory_budget_bytes: the encoder's working-set budget (it sets the chunk of coordinates per scan step).
      chunk_size: coordinates per encoder step (an int ``>= 1``), overriding the budget (tests).
      crc32: append a CRC-32 of (shared key data, prior fingerprint, stream) to every uplink message (+32
        bits; see :mod:`sidejax.coding.klms`). Off by default.
    """

    log2_num_candidates: int = 8
    block_size: int = 256
    max_block_size: int = 2048
    trigger_factor: float = 3.0
    initial_update: bool = False
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    chunk_size: int | None = None
    crc32: bool = False

    def __post_init__(self):
        k = self.log2_num_candidates
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 24:
            raise ValueError(
                "log2_num_candidates must be an int in 1..24 (K* bits per block, n_IS = 2**K* candidates; "
                f"K* >= 1 because it is also the target KL per block), got {k!r}"
            )
        m = self.max_block_size
        if isinstance(m, bool) or not isinstance(m, int) or m < 2 or m & (m - 1) or m > 2**_MAX_LOG2_BLOCK:
            raise ValueError(
                f"max_block_size must be a power of two in 2..2**{_MAX_LOG2_BLOCK} (a size is sent as "
                f"size - 1 in log2(max_block_size) bits), got {m!r}"
            )
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= m:
            raise ValueError(f"block_size must be an int in 1..max_block_size={m}, got {b!r}")
        f = self.trigger_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (math.isfinite(f) and f > 1):
            raise ValueError(
                f"trigger_factor must be a finite number > 1 (requests fire outside [1/f, f]), got {f!r}"
            )
        if not isinstance(self.initial_update, bool):
            raise ValueError(f"initial_update must be a bool, got {self.initial_update!r}")
        if not isinstance(self.memory_budget_bytes, int) or self.memory_budget_bytes < 1:
            raise ValueError(f"memory_budget_bytes must be an int >= 1, got {self.memory_budget_bytes!r}")
        c = self.chunk_size
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"chunk_size must be None or an int >= 1, got {c!r}")
        if not isinstance(self.crc32, bool):
            raise ValueError(f"crc32 must be a bool, got {self.crc32!r}")

    @property
    def length_bits(self) -> int:
        """:math:`L = \\log_2 b_{max}`, the width of a size field."""
        return self.max_block_size.bit_length() - 1

    def chunk(self, dim: int) -> int:
        """Coordinates per encoder scan step: ``chunk_size``, or the largest even chunk whose working set
        (candidates, log-weights and the per-row selection: ``[K, C]`` arrays) fits the memory budget."""
        if self.chunk_size is not None:
            return self.chunk_size
        budget = self.memory_budget_bytes * _CANDIDATE_ARRAYS // (_CANDIDATE_ARRAYS + _SELECT_ARRAYS)
        return choose_chunk_size(dim, 2**self.log2_num_candidates, budget)

    def capacity_words(self, dim: int) -> int:
        """Words of the uplink buffer: the longest message (block size 1, an update round)."""
        return max(1, num_words(1, dim * self.log2_num_candidates + 1 + self.length_bits + 32 * self.crc32))


class KLMSAvgState(NamedTuple):
    """The protocol state (the server's, and every receiver's copy).

    Attributes:
      block_size: int32, :math:`b_t`, the size of the blocks of the coming round (``1..max_block_size``).
      update: bool, the coming round is an update round (clients propose sizes).
      changed: bool, the last round was an update round, so the downlink carries the size.
      dim: int32, the length :math:`d` of the flat vector the blocks tile (fixed at ``init``; the stream's
        length, :func:`klms_avg_frame`, depends on it and on nothing the receiver lacks).
    """

    block_size: jax.Array
    update: jax.Array
    changed: jax.Array
    dim: jax.Array


class KLMSAvgClientInfo(NamedTuple):
    """Client-side diagnostics (the message length is in the Message).

    Attributes:
      kl_bits: :math:`D_{KL}(q \\| p)` in bits, the ideal rate (not a code length).
      num_blocks: :math:`M_t = \\lceil d / b_t \\rceil`.
      num_fallback_blocks: blocks whose candidates all had ``q = 0`` (uniform index sent).
      mean_block_kl_bits: :math:`\\bar D_i = D_{KL} / M_t`, the request statistic.
      request: the request bit sent.
      proposal: the proposed size :math:`b_i` (sent in update rounds only).
      valid: ``q`` and ``p`` are valid distributions and the KL is finite (inside jit the only signal).
    """

    kl_bits: jax.Array
    num_blocks: jax.Array
    num_fallback_blocks: jax.Array
    mean_block_kl_bits: jax.Array
    request: jax.Array
    proposal: jax.Array
    valid: jax.Array

    ideal_bits = kl_ideal_bits


class KLMSAvgDecoded(NamedTuple):
    """What the server reads from one client's stream besides the sample.

    Attributes:
      request: the client's request bit.
      proposal: its proposed size in update rounds; the round's size otherwise (no proposal).
      num_blocks: blocks in the stream.
      valid: the stream is well formed (``errors == 0``).
      errors: int32 bitmask of ``ERR_*`` (:func:`sidejax.coding.stream_errors`).
    """

    request: jax.Array
    proposal: jax.Array
    num_blocks: jax.Array
    valid: jax.Array
    errors: jax.Array


class KLMSAvgServerInfo(NamedTuple):
    """Server-side protocol diagnostics.

    Attributes:
      updated: this round was an update round.
      next_update: the next round is an update round.
      block_size: the size of the next round's blocks.
      num_requests: participants that requested an update.
      streams_valid: bool ``[clients]``, each participant's stream was well formed (a driver stops the run
        on a false entry: that client's sample and what was aggregated from it are garbage).
      stream_errors: int32 ``[clients]``, each participant's error bitmask.
    """

    updated: jax.Array
    next_update: jax.Array
    block_size: jax.Array
    num_requests: jax.Array
    streams_valid: jax.Array
    stream_errors: jax.Array


def _num_blocks(dim: int, block_size) -> jax.Array:
    b = jnp.asarray(block_size, jnp.int32)
    return ((dim - 1) // b + 1).astype(jnp.int32)


def equal_blocks(dim: int, block_size) -> Blocks:
    """The partition of ``[0, dim)`` into blocks of ``block_size`` (traced int ``>= 1``) coordinates, the last
    one shorter, as :class:`sidejax.blocks.Blocks` with the static bound ``max_blocks = dim``."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    b = jnp.asarray(block_size, jnp.int32)
    M = _num_blocks(dim, b)
    m = jnp.arange(dim + 1, dtype=jnp.int32)
    starts = jnp.minimum(jnp.minimum(m, M) * b, dim)  # min(m, M) * b <= dim + b - 1: no int32 overflow
    block_ids = jnp.arange(dim, dtype=jnp.int32) // b
    return Blocks(block_ids, starts.astype(jnp.int32), M, jnp.asarray(False))


def _rows_needed(chunk_size: int, block_size):
    """A chunk of ``C`` coordinates touches at most ``min(C, (C - 1) // b + 2)`` blocks of size ``b``."""
    return jnp.minimum(chunk_size, (chunk_size - 1) // block_size + 2)


def row_buckets(chunk_size: int, max_block_size: int) -> tuple[int, ...]:
    """The static numbers of block rows per chunk that :func:`equal_blocks_encode` compiles, one
    ``lax.switch`` branch each: ``r0 * 8**i`` below ``chunk_size``, then ``chunk_size``, where
    ``r0 = min(C, (C - 1) // max_block_size + 2)`` is what a chunk of ``C`` coordinates needs for the largest
    blocks (smaller blocks need more rows: ``min(C, (C - 1) // b + 2)``)."""
    out, r = [], min(chunk_size, (chunk_size - 1) // max_block_size + 2)
    while r < chunk_size:
        out.append(r)
        r *= _ROW_BUCKET_FACTOR
    return (*out, chunk_size)


def _select(logw: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of ``logw[R, K]``: the index drawn from ``softmax(logw)`` by inversion with ``u[R]`` in (0, 1)
    (uniform over K where every log-weight is ``-inf``); returns ``(indices, dead)``."""
    K = logw.shape[1]
    mx = jnp.max(logw, axis=1, keepdims=True)
    dead = mx[:, 0] == -jnp.inf
    w = jnp.exp(jnp.where(dead[:, None], 0.0, logw - mx))
    cdf = jnp.cumsum(w, axis=1)
    k = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=1)
    return jnp.minimum(k, K - 1).astype(jnp.int32), dead


def equal_blocks_encode(
    shared_key,
    private_key,
    q,
    p,
    block_size,
    *,
    log2_num_candidates: int,
    max_block_size: int,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """One importance-sampling index per block of ``block_size`` (a traced int ``>= 1``) coordinates, in
    working memory :math:`O(K C + d)` whatever the block size (see the module docstring).

    A ``lax.scan`` over chunks of ``chunk_size`` coordinates: chunk :math:`c` covers ``[cC, (c+1)C)``, whose
    first block is :math:`f = \\lfloor cC / b \\rfloor`; it touches blocks :math:`f..f+C-1` at most, adds
    the log-weights :math:`\\log q_j(y_{k,j}) - \\log p_j(y_{k,j})` of its coordinates to rows
    :math:`\\lfloor j / b \\rfloor - f` of a ``[C, K]`` array (row 0 plus the partial sums carried from
    earlier chunks), chooses the index of every block that ends in the chunk and carries the last row when
    its block continues.

    Args:
      shared_key: the candidates' key (both ends).
      private_key: the sender's key (the index choice).
      q: the sender's factorized distribution, coordinates on axis 0.
      p: the shared prior, same type and shape.
      block_size: int32 scalar in ``1..max_block_size``, may be traced (a value out of range is clipped
        into it, inside ``jit`` and outside it; :func:`klms_avg_encode` flags such a state invalid).
      log2_num_candidates: :math:`\\log_2 K` (static).
      max_block_size: the largest block size (static; it bounds the rows a chunk can need).
      chunk_size: coordinates per step (static, ``>= 1``).

    Returns:
      ``(indices, num_fallback_blocks)``: int32 ``[dim]`` indices (entries ``>= ceil(dim / block_size)``
      are 0) and the number of blocks whose candidates all had ``q = 0``.
    """
    dim = dist_dim(q)
    check_dims(dim, "q has", "q and p must describe the same vector", p=p)
    _check_chunk_size(chunk_size)
    K = 2**log2_num_candidates
    C = int(chunk_size)
    num_chunks = -(-dim // C)
    pad = num_chunks * C - dim
    qp, pp = _pad(q, pad), _pad(p, pad)
    if isinstance(max_block_size, bool) or not isinstance(max_block_size, int) or max_block_size < 1:
        raise ValueError(f"max_block_size must be an int >= 1, got {max_block_size!r}")
    b = jnp.asarray(block_size, jnp.int32)
    if jnp.ndim(b) != 0:
        raise ValueError(f"block_size must be a scalar, got shape {jnp.shape(b)}")
    b = jnp.clip(b, 1, max_block_size)
    M = _num_blocks(dim, b)
    init = (jnp.zeros(K, jnp.float32), jnp.zeros(dim, jnp.int32), jnp.int32(0))

    def scan(R: int):
        """The encoder with ``R`` block rows per chunk (static; must exceed every local row index)."""
        rows = jnp.arange(R, dtype=jnp.int32)
        offsets = jnp.arange(C, dtype=jnp.int32)

        def step(carry, c):
            acc, indices, fallback = carry
            start = c * C
            first = start // b
            u = chunk_uniforms(shared_key, K, start, C)  # [K, C], the candidates' shared uniforms
            pc, qc = _slice(pp, start, C), _slice(qp, start, C)
            y = candidate_values(pc, u)
            logr = qc.log_prob(y) - pc.log_prob(y)
            j = start + offsets
            logr = jnp.where((j < dim)[None, :], logr, 0.0)  # padding coordinates add nothing
            part = jax.ops.segment_sum(logr.T, j // b - first, num_segments=R, indices_are_sorted=True)
            part = part.at[0].add(acc)  # the block continued from the previous chunk
            stop = jnp.minimum(start + C, dim)
            m = first + rows  # each row's block; the comparisons below avoid m * b (int32 overflow)
            touched = m <= (stop - 1) // b
            complete = touched & ((m + 1 <= stop // b) | ((m == M - 1) & (stop == dim)))
            k_star, dead = _select(part, candidate_uniforms(private_key, m, jnp.zeros_like(m)))
            indices = indices.at[jnp.where(complete, m, dim)].set(k_star, mode="drop")
            last = (stop - 1) // b - first
            acc = jnp.where(complete[last], 0.0, part[last])
            fallback = fallback + jnp.sum(dead & complete).astype(jnp.int32)
            return (acc, indices, fallback), None

        (_, indices, fallback), _ = jax.lax.scan(step, init, jnp.arange(num_chunks, dtype=jnp.int32))
        return indices, fallback

    # run the smallest static row bucket that holds the blocks a chunk touches (one lax.switch branch per
    # bucket; b is the same for every client, so under vmap over clients only that branch runs). The
    # buffers of all branches share one allocation sized to the largest, [C, K], the chunk's working set.
    buckets = row_buckets(C, max_block_size)
    need = _rows_needed(C, b)
    if len(buckets) == 1:
        return scan(buckets[0])
    branch = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), need), len(buckets) - 1)
    return jax.lax.switch(branch, [functools.partial(scan, R) for R in buckets])


def klms_avg_init(dim: int, config: KLMSAvgConfig) -> KLMSAvgState:
    """The initial state: blocks of ``config.block_size``; an update round first iff
    ``config.initial_update``."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be an int >= 1, got {dim!r}")
    return KLMSAvgState(
        jnp.int32(config.block_size), jnp.asarray(config.initial_update), jnp.asarray(False), jnp.int32(dim)
    )


def _check_state(state: KLMSAvgState) -> None:
    """``ValueError`` for a state whose size or ``dim`` is not a scalar (static). Their values are checked
    in the computation, inside ``jit`` and outside it alike (:func:`_state_fits`): a state whose size is
    out of range or whose ``dim`` is not the distributions' gives the encoder's ``valid = False`` and the
    decoder's ``ERR_PARSE``."""
    if jnp.ndim(state.block_size) != 0 or jnp.ndim(state.dim) != 0:
        raise ValueError(
            "state.block_size and state.dim must be scalars, got shapes "
            f"{jnp.shape(state.block_size)} and {jnp.shape(state.dim)}"
        )


def _state_fits(state: KLMSAvgState, config: KLMSAvgConfig, dim: int) -> jax.Array:
    """bool scalar: the state's block size is in ``1..max_block_size`` and it was built for ``dim``."""
    b = state.block_size
    return (b >= 1) & (b <= config.max_block_size) & (state.dim == dim)


def _proposal(kl_total, dim: int, config: KLMSAvgConfig) -> jax.Array:
    """:math:`\\mathrm{clip}(\\mathrm{round}(K^* d / D_{KL}), 1, b_{max})` (``b_max`` for zero KL)."""
    ratio = jnp.float32(config.log2_num_candidates * dim) / kl_total.astype(jnp.float32)
    b = jnp.clip(jnp.round(ratio), 1, config.max_block_size)
    return jnp.where(kl_total > 0, b, config.max_block_size).astype(jnp.int32)


def klms_avg_encode(
    keys: ClientKeys, q, p, state: KLMSAvgState, config: KLMSAvgConfig
) -> tuple[Message, KLMSAvgClientInfo]:
    """One client's Adaptive-Avg message (stream layout in the module docstring).

    Args:
      keys: the client's keys (shared: candidates; private: index choice).
      q: the client-only factorized distribution over the flat vector.
      p: the shared prior, same type and shape.
      state: the :class:`KLMSAvgState` every party holds for this round.
      config: static settings.

    Returns:
      ``(message, info)``. ``message.num_bits`` is :math:`M_t K^* + 1 (+ L) (+ 32)`, the fields written.
      The payload is the static-capacity buffer (:meth:`KLMSAvgConfig.capacity_words`), inside ``jit`` and
      outside it, of which the first ``ceil(num_bits / 32)`` words are sent (the rest are zero).
    """
    dim = dist_dim(q)
    check_dims(dim, "q has", "q and p must describe the same flat vector", p=p)
    _check_state(state)
    k, L = config.log2_num_candidates, config.length_bits
    b = state.block_size.astype(jnp.int32)
    indices, fallback = equal_blocks_encode(
        keys.shared,
        keys.private,
        q,
        p,
        b,
        log2_num_candidates=k,
        max_block_size=config.max_block_size,
        chunk_size=config.chunk(dim),
    )
    M = _num_blocks(dim, b)
    kl_total = jnp.sum(q.kl_bits(p))
    dbar = kl_total / M.astype(jnp.float32)
    ratio = dbar / jnp.float32(k)
    f = float(config.trigger_factor)
    request = ~((ratio >= jnp.float32(1.0 / f)) & (ratio <= jnp.float32(f)))  # NaN requests too
    proposal = _proposal(kl_total, dim, config)
    update = jnp.asarray(state.update, bool)

    words = jnp.zeros(config.capacity_words(dim), jnp.uint32)
    words = pack_fixed(jnp.where(jnp.arange(dim) < M, indices, 0), k, out=words)
    offset = M * k
    words = pack_fixed(request.astype(jnp.uint32)[None], 1, bit_offset=offset, out=words)
    offset = offset + 1
    words = pack_fixed(jnp.where(update, proposal - 1, 0)[None], L, bit_offset=offset, out=words)
    offset = offset + jnp.where(update, L, 0)
    if config.crc32:
        words = pack_fixed(stream_crc(keys.shared, p, words, offset)[None], 32, bit_offset=offset, out=words)
        offset = offset + 32
    num_bits = as_bits(offset)
    info = KLMSAvgClientInfo(
        kl_bits=kl_total,
        num_blocks=M,
        num_fallback_blocks=fallback,
        mean_block_kl_bits=dbar,
        request=request,
        proposal=proposal,
        valid=is_valid(q) & is_valid(p) & jnp.isfinite(kl_total) & _state_fits(state, config, dim),
    )
    return Message(words, num_bits), info


def klms_avg_decode(shared_key, p, state: KLMSAvgState, message: Message, config: KLMSAvgConfig):
    """The server's side for one client: parse the stream, regenerate the chosen candidates.

    Reads exactly the ``ceil(num_bits / 32)`` words sent; the payload may be the encoder's capacity buffer
    or exactly those words, and the decoder never raises on the stream's contents (the same inside ``jit``
    and outside it): a shorter buffer than ``num_bits`` claims, set bits past ``num_bits``, fields that do
    not add up to ``num_bits``, an invalid ``p`` or a CRC mismatch give ``valid = False`` and the reasons
    in ``errors``.

    Returns:
      ``(sample[dim], KLMSAvgDecoded)``.
    """
    dim = dist_dim(p)
    _check_state(state)
    k, L = config.log2_num_candidates, config.length_bits
    words, ok_length = received_words(message, config.capacity_words(dim))
    b = state.block_size.astype(jnp.int32)
    update = jnp.asarray(state.update, bool)
    M = _num_blocks(dim, b)
    indices = unpack_fixed(words, dim, k).astype(jnp.int32)
    indices = jnp.where(jnp.arange(dim) < M, indices, 0)
    offset = M * k
    request = unpack_fixed(words, 1, 1, bit_offset=offset)[0] > 0
    offset = offset + 1
    sent = unpack_fixed(words, 1, L, bit_offset=offset)[0].astype(jnp.int32) + 1
    proposal = jnp.where(update, sent, b)
    offset = offset + jnp.where(update, L, 0)
    ok_crc = jnp.asarray(True)
    if config.crc32:
        ok_crc = unpack_fixed(words, 1, 32, bit_offset=offset)[0] == stream_crc(shared_key, p, words, offset)
        offset = offset + 32
    # the lengths of the fields read, from the receiver's state, add up to num_bits (and the state's size is
    # in range and it is the one built for this vector, which the frame of a relayed stream relies on)
    ok_parse = (offset == as_bits(message.num_bits)) & _state_fits(state, config, dim)
    errors = failed_checks(length=ok_length, parse=ok_parse, prior=is_valid(p), crc=ok_crc)
    valid = errors == 0
    sample = importance_decode(shared_key, p, equal_blocks(dim, b), indices)
    return sample, KLMSAvgDecoded(request, proposal, M, valid, errors)


def _round_mean(values: jax.Array, include: jax.Array) -> jax.Array:
    """``round(mean(values[include]))`` of int32 values, half to even, in exact integer arithmetic (1 when
    none is included)."""
    n = jnp.maximum(jnp.sum(include.astype(jnp.int32)), 1)
    total = jnp.sum(jnp.where(include, values.astype(jnp.int32), 0))
    quot = total // n
    rem = total - quot * n
    up = (2 * rem > n) | ((2 * rem == n) & (quot % 2 == 1))
    return (quot + up).astype(jnp.int32)


def klms_avg_server_update(
    state: KLMSAvgState, decoded: KLMSAvgDecoded, config: KLMSAvgConfig
) -> tuple[KLMSAvgState, KLMSAvgServerInfo]:
    """The server's protocol step, given every participant's :class:`KLMSAvgDecoded` stacked on axis 0.

    After an update round: :math:`b \\leftarrow \\mathrm{round}(\\mathrm{mean}_i\\, b_i)` (half to even),
    ``update`` cleared, ``changed`` set. After another round: :math:`b` kept, ``update`` set iff any
    participant requested it, ``changed`` cleared.
    """
    valid, errors = jnp.asarray(decoded.valid, bool), jnp.asarray(decoded.errors, jnp.int32)
    if valid.ndim != 1 or valid.shape[0] < 1:
        raise ValueError(
            "decoded must be stacked over the participating clients (axis 0, at least one), got valid of "
            f"shape {valid.shape}"
        )
    _check_state(state)
    update = jnp.asarray(state.update, bool)
    # the Coder contract: only the participants whose decoded.valid is True count; with none, the state
    # is kept
    requests = jnp.asarray(decoded.request, bool) & valid
    proposals = jnp.asarray(decoded.proposal, jnp.int32)
    mean_size = jnp.clip(_round_mean(proposals, valid), 1, config.max_block_size)
    block_size = jnp.where(update, mean_size, state.block_size).astype(jnp.int32)
    next_update = ~update & jnp.any(requests)
    new_state = keep_unless_none(valid, KLMSAvgState(block_size, next_update, update, state.dim), state)
    block_size = new_state.block_size
    info = KLMSAvgServerInfo(
        update, next_update, block_size, jnp.sum(requests).astype(jnp.int32), valid, errors
    )
    return new_state, info


def klms_avg_downlink(state: KLMSAvgState, config: KLMSAvgConfig) -> Message:
    """The protocol's downlink: the ``update`` flag (1 bit), then after an update round (``changed``) the
    block size minus one (``log2(max_block_size)`` bits): ``1 + L [changed]`` bits."""
    L = config.length_bits
    changed = jnp.asarray(state.changed, bool)
    words = jnp.zeros(num_words(1, 1 + L), jnp.uint32)
    words = pack_fixed(jnp.asarray(state.update, jnp.uint32)[None], 1, out=words)
    size = jnp.where(changed, state.block_size.astype(jnp.int32) - 1, 0)
    words = pack_fixed(size[None], L, bit_offset=1, out=words)
    return Message(words, as_bits(1 + jnp.where(changed, L, 0)))


def klms_avg_receive(state: KLMSAvgState, message: Message, config: KLMSAvgConfig) -> KLMSAvgState:
    """The receivers' side of :func:`klms_avg_downlink`. ``state`` is the receiver's knowledge: its size
    (kept when none was sent) and ``changed`` (the ``update`` flag it received the round before, which says
    whether a size follows the flag). The state returned is its knowledge for the next downlink too: its
    ``changed`` is the flag just received, as in the server's state after its update."""
    L = config.length_bits
    cap = num_words(1, 1 + L)
    payload = jnp.asarray(message.payload, jnp.uint32)
    if payload.ndim != 1:
        raise ValueError(f"message.payload must be a 1-D word array, got shape {payload.shape}")
    words = jnp.pad(payload, (0, max(0, cap - payload.shape[0])))
    words, _ = mask_to_length(words, message.num_bits)
    update = unpack_fixed(words, 1, 1)[0] > 0
    changed = jnp.asarray(state.changed, bool)
    size = unpack_fixed(words, 1, L, bit_offset=1)[0].astype(jnp.int32) + 1
    block_size = jnp.where(changed, size, state.block_size).astype(jnp.int32)
    return KLMSAvgState(block_size, update, update, state.dim)


def klms_avg_frame(state: KLMSAvgState, words: jax.Array, bit_offset, config: KLMSAvgConfig) -> jax.Array:
    """The length in bits of the message starting at ``bit_offset`` of ``words``: determined by the state
    alone, :math:`\\lceil d / b_t \\rceil K^* + 1 + L [update] + 32 [crc32]` (``words`` and ``bit_offset``
    are not read; :attr:`sidejax.coding.Coder.frame`)."""
    del words, bit_offset
    M = _num_blocks(state.dim, state.block_size)
    extra = 1 + jnp.where(jnp.asarray(state.update, bool), config.length_bits, 0) + 32 * config.crc32
    return as_bits(M * config.log2_num_candidates + extra)


def klms_avg_coder(config: KLMSAvgConfig) -> Coder:
    """The Adaptive-Avg KLMS coder (:class:`sidejax.coding.Coder`) of BICompFL: equal-sized blocks whose one
    size adapts to the clients' average KL (see the module docstring). ``config`` enters here once; ``q`` and
    ``p`` are factorized distributions over the flat vector (:mod:`sidejax.distributions`)."""
    if not isinstance(config, KLMSAvgConfig):
        raise TypeError(f"klms_avg_coder needs a KLMSAvgConfig, got {type(config).__name__}")
    protocol = (
        klms_avg_init,
        klms_avg_encode,
        klms_avg_decode,
        klms_avg_server_update,
        klms_avg_downlink,
        klms_avg_receive,
        klms_avg_frame,
    )
    # shared candidates, a private choice; the block size, hence the index count, and the size field follow
    # the protocol (no fixed length)
    return configured_coder(config, protocol, name="klms-avg", deterministic=False, fixed_bits=None)
