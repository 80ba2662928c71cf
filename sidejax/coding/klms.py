"""The KLMS uplink protocol: Fixed-/Adaptive-KLMS messages and the block-update protocol.

Isik, Pase et al., "Adaptive Compression in Federated Learning via Side Information" (AISTATS 2024):
Alg. 5 (Fixed-KLMS), Alg. 6 (Adaptive-KLMS), Alg. 7 (Aggregate-Block-Locations), Alg. 8 (decoder) and the
update protocol shared by Alg. 9-12 (docs/papers/klms.md#s3-2). Framework-agnostic: a framework supplies
the client-only distribution ``q`` and the shared prior ``p`` (:mod:`sidejax.distributions`); this module
turns them into a real bitstream and back.

**Protocol** (adaptive mode). The server holds a partition :math:`I^{(t)}` and a flag ``update``.

- Client: if ``update``, it re-partitions with :func:`sidejax.blocks.kl_blocks` so that every block's KL is
  about :math:`D_{target} = \\log_2 K` bits (capped at ``max_block_size`` coordinates), else it uses
  :math:`I^{(t)}`. It encodes one index per block (:func:`sidejax.coding.importance_encode`) and sends
  the trigger statistic: :math:`\\bar D^{(t,c)} = \\frac1M \\sum_m D_{KL}(q_{I_m} \\| p_{I_m})`
  (``"thresholds"``)
  or the reference code's :math:`\\bar\\rho = \\frac1M\\sum_m \\min(\\log_2 K / D_m, 100)` (``"rho"``).
- Server: decodes every client with the client's own partition in update rounds, then sets
  :math:`I^{(t+1)} =` Aggregate-Block-Locations of the clients' partitions and clears ``update``; in other
  rounds it sets ``update`` when the mean statistic leaves :math:`[\\bar D_{min}, \\bar D_{max}]`
  (defaults :math:`D_{target}/3` and :math:`2 D_{target}`, docs/papers/klms.md#s3-6 [R]) or, with ``"rho"``,
  when :math:`\\bar\\rho > 3` ([C]).

Deviation [R] (docs/papers/klms.md#d-cap-bound): the lower trigger (and the rho trigger) is suppressed when
the partition is *cap-bound* (every block already has ``max_block_size`` coordinates). A re-partition cannot
enlarge such blocks, so the paper's rule would re-partition every other round for nothing once the KL is
small, and pay :math:`M \\log_2(\\text{MAX\\_BLOCK\\_SIZE})` bits each time.

**Bitstream** (one ``uint32`` buffer per client, LSB first; :mod:`sidejax.coding.bitstream`):

====================  ===========================================  ========================
field                 width                                        present
====================  ===========================================  ========================
block lengths - 1     ``M * log2(max_block_size)``                 update rounds (adaptive)
indices               ``M * log2 K``                               always
statistic (float32)   32                                           adaptive
CRC-32                32                                           ``config.crc32``
====================  ===========================================  ========================

The message length is exactly the sum of the present fields (docs/papers/klms.md#s3-7; the paper's Alg. 9-12
print ``K*M``, corrected to ``M log2 K``). In update rounds the server learns ``M`` from the lengths (they sum
to ``dim``), so no header is needed; otherwise ``M`` is the number of blocks of :math:`I^{(t)}`.

**Length and integrity.** The receiver reads exactly the ``ceil(num_bits / 32)`` words sent; a length that
does not match the fields (truncated, padded, or block lengths not summing to ``dim``) is invalid
(:attr:`KLMSDecoded.valid`, :attr:`KLMSDecoded.errors`; the host API raises). Without a checksum a
*well-formed* but corrupted stream is not detectable: a flipped index bit selects another candidate, and
a wrong shared key regenerates other candidates, and both decode silently to a wrong sample (valid). With
``KLMSConfig(crc32=True)`` the stream ends in a CRC-32 (zlib's polynomial) of the client's shared key data, a
32-bit fingerprint of the prior ``p`` (:func:`sidejax.coding.prior_fingerprint`) and every earlier bit of the
stream (:func:`sidejax.coding.crc32_words`): any error burst of up to 32 bits (every single flipped bit) is
detected, and so is a receiver whose prior differs from the sender's in any coordinate (the fingerprint
changes with every single changed value; BICompFL's parties must hold bit-identical priors), a wrong key or
any other corruption with probability :math:`1 - 2^{-32}`. It is an error check, not an authenticator (a CRC
is linear; use a MAC against an adversary). Cost: 32 bits per message, counted in ``num_bits``: at the
``klms_fmnist`` preset size (LeNet5, ``dim`` = 61,706) that is 32 / 61,706 = 0.00052 bpp per client per round,
1.7% of the FedPM-KLMS uplink measured there (0.0301 bpp, docs/papers/klms.md#walkthrough). Off by default, as
in the paper.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax.bits import as_bits
from sidejax.blocks import (
    Blocks,
    aggregate_block_locations,
    block_sizes,
    blocks_from_boundaries,
    blocks_from_starts,
    kl_blocks,
)
from sidejax.coding.base import (
    Coder,
    LivePrefix,
    Message,
    configured_coder,
    failed_checks,
    kl_ideal_bits,
    stream_crc,
    stream_errors,
)
from sidejax.coding.bitstream import (
    mask_to_length,
    pack_fixed,
    received_words,
    unpack_fixed,
)
from sidejax.coding.importance import DEFAULT_MEMORY_BUDGET_BYTES, encode_bounded, importance_decode
from sidejax.distributions import check_dims, is_valid
from sidejax.keys import ClientKeys
from sidejax.utils import keep_unless_none, masked_mean

__all__ = [
    "TRIGGERS",
    "KLMSConfig",
    "KLMSState",
    "KLMSClientInfo",
    "KLMSDecoded",
    "KLMSServerInfo",
    "klms_init",
    "klms_encode",
    "klms_decode",
    "klms_server_update",
    "klms_downlink",
    "klms_receive",
    "klms_frame",
    "klms_coder",
    "stream_errors",
]

TRIGGERS = ("thresholds", "rho")
_RHO_CAP = 100.0


@dataclasses.dataclass(frozen=True)
class KLMSConfig:
    """Static settings of the KLMS coder (hashable, so it can be closed over by jitted functions).

    Attributes:
      log2_num_candidates: :math:`\\log_2 K` (K candidates per block). In adaptive mode the target KL per
        block is :math:`D_{target} = \\log_2 K - r` bits ([C] ``kl_rate``; default 2, so K = 4).
      overhead_bits: the overhead :math:`r` in bits (default 0, as the paper and [C]): blocks are sized to
        :math:`\\log_2 K - r` bits of KL, so each block has :math:`2^r` times more candidates than its KL
        asks for and the sample is closer to ``q`` (Thm 4.1's :math:`K = e^{KL + r}`;
        docs/papers/klms.md#s8-15, docs/papers/klms.md#s8-21).
      adaptive: Adaptive-KLMS (Alg. 6 + update protocol) if True, Fixed-KLMS (Alg. 5) if False.
      block_size: the fixed block size S (Fixed-KLMS), and the initial partition of Adaptive-KLMS ([C]: 8).
      max_block_size: the cap MAX_BLOCK_SIZE, a power of two >= 2 ([C]: 256 for FedPM, 16 for SGLD).
      trigger: ``"thresholds"`` (paper) or ``"rho"`` (reference code).
      dbar_min: lower threshold on the mean block KL in bits (default ``D_target / 3``).
      dbar_max: upper threshold (default ``2 * D_target``).
      rho_threshold: re-partition when the mean rho exceeds this (``"rho"`` trigger; [C] 3).
      max_blocks: static bound on the number of blocks (default ``dim`` in adaptive mode: never overflows).
      memory_budget_bytes: encoder working-set budget (chunking over coordinates).
      crc32: append a CRC-32 of (shared key data, prior fingerprint, stream) to every message (+32 bits;
        see the module docstring). Off by default: then flipped bits, a wrong shared key and a receiver
        whose prior differs from the sender's all decode silently.
      bucketed: size the encoder's per-block work (a ``[blocks, K]`` log-weight accumulator and Gumbel
        draw) to the smallest static bucket (:meth:`work_buckets`) that holds the live block count, not
        to ``max_blocks`` (= ``dim``); same indices and bits for the same keys (see
        :func:`sidejax.coding.importance.encode_bounded`). Applies in rounds that use the broadcast
        partition, whose count is known to every client; update rounds (each client's own partition)
        keep the full bound unless ``bucket_update_rounds``. This saves *compute* (only the chosen branch
        runs), not peak memory: XLA reserves one temporary buffer for all branches of a ``lax.switch``,
        sized to the largest (measured on this encoder at dim 61,706, K = 256: 316 MiB of temporaries
        bucketed, 317 MiB not). :func:`sidejax.coding.klms_avg_coder`'s streaming encoder is the one whose
        memory is bounded for every block size.
      bucket_update_rounds: also bucket update rounds, by each client's own block count. Turn it on only
        when clients run one at a time (``lax.map``, the CPU default): under ``vmap`` that count differs
        per client, so ``lax.switch`` becomes a select and every bucket would run.
    """

    log2_num_candidates: int = 2
    overhead_bits: float = 0.0
    adaptive: bool = True
    block_size: int = 8
    max_block_size: int = 256
    trigger: str = "thresholds"
    dbar_min: float | None = None
    dbar_max: float | None = None
    rho_threshold: float = 3.0
    max_blocks: int | None = None
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    crc32: bool = False
    bucketed: bool = True
    bucket_update_rounds: bool = False

    def __post_init__(self):
        b = self.log2_num_candidates
        lo = 1 if self.adaptive else 0
        if not isinstance(b, int) or not lo <= b <= 24:
            raise ValueError(
                f"log2_num_candidates must be an int in {lo}..24 (K = 2**log2_num_candidates; adaptive mode "
                f"needs K >= 2 because the target KL per block is log2 K bits), got {b!r}"
            )
        if not 0 <= self.overhead_bits < max(b, 1):
            raise ValueError(
                f"overhead_bits must be in [0, log2_num_candidates={b}) (the target KL per block is "
                f"log2 K - overhead > 0), got {self.overhead_bits}"
            )
        m = self.max_block_size
        if not isinstance(m, int) or m < 2 or m & (m - 1):
            raise ValueError(f"max_block_size must be a power of two >= 2, got {m!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.adaptive and self.block_size > m:
            raise ValueError(f"block_size={self.block_size} exceeds max_block_size={m}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {TRIGGERS}, got {self.trigger!r}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError(f"max_blocks must be None or >= 1, got {self.max_blocks}")
        if not self.dbar_lo < self.dbar_hi:
            raise ValueError(f"need dbar_min < dbar_max, got {self.dbar_lo} and {self.dbar_hi}")

    @property
    def target_bits(self) -> float:
        return float(self.log2_num_candidates) - float(self.overhead_bits)

    @property
    def length_bits(self) -> int:
        return int(math.log2(self.max_block_size))

    @property
    def dbar_lo(self) -> float:
        return self.target_bits / 3 if self.dbar_min is None else float(self.dbar_min)

    @property
    def dbar_hi(self) -> float:
        return 2 * self.target_bits if self.dbar_max is None else float(self.dbar_max)

    def num_max_blocks(self, dim: int) -> int:
        """The static bound on the number of blocks for a vector of length ``dim``."""
        if not self.adaptive:
            return -(-dim // self.block_size)
        return min(dim, self.max_blocks) if self.max_blocks else dim

    def work_buckets(self, dim: int) -> tuple[int, ...]:
        """Static bounds for the encoder's per-block work: powers of 4 times the smallest power of two that
        holds ``ceil(dim / max_block_size)`` blocks (no partition has fewer), ending at
        :meth:`num_max_blocks`. Each bucket is one compiled branch of the encoder."""
        mb = self.num_max_blocks(dim)
        if not self.adaptive:  # fixed blocks: always max_blocks of them
            return (mb,)
        w = 1 << max(0, (-(-dim // self.max_block_size) - 1).bit_length())
        out = []
        while w < mb:
            out.append(w)
            w *= 4
        return (*out, mb)

    def fixed_bits(self, dim: int) -> int:
        """Fixed mode: the length of every message, ``ceil(dim / block_size) log2 K`` (+ 32 with the CRC);
        adaptive messages have no fixed length (block lengths in update rounds, a partition of any size)."""
        if self.adaptive:
            raise ValueError("adaptive KLMS messages have no fixed length (KLMSConfig(adaptive=True))")
        return self.num_max_blocks(dim) * self.log2_num_candidates + (32 if self.crc32 else 0)

    def capacity_words(self, dim: int) -> int:
        """Words of the message buffer (the longest possible message)."""
        mb = self.num_max_blocks(dim)
        per_block = self.log2_num_candidates + (self.length_bits if self.adaptive else 0)
        tail = (32 if self.adaptive else 0) + (32 if self.crc32 else 0)
        return max(1, -(-(mb * per_block + tail) // 32))


class KLMSState(NamedTuple):
    """The protocol's server state (broadcast to the clients).

    Attributes:
      blocks: the current global partition :math:`I^{(t)}`.
      update: bool, clients re-partition in the coming round.
      changed: bool, ``blocks`` changed in the last server step (so the downlink must carry them).
    """

    blocks: Blocks
    update: jax.Array
    changed: jax.Array


class KLMSClientInfo(NamedTuple):
    """Client-side diagnostics (ideal rates are labelled as such; the message length is in the Message).

    Attributes:
      kl_bits: the ideal rate :math:`\\sum_j D_{KL}(q_j \\| p_j)` in bits (not a code length).
      num_blocks: blocks used this round.
      num_fallback_blocks: blocks where every candidate had ``q = 0`` (uniform index sent).
      overflow: the partition needed more than ``max_blocks`` blocks (the tail was merged).
      statistic: the reported trigger statistic (mean block KL in bits, or mean rho).
      valid: bool, ``q`` and ``p`` are valid distributions (``is_valid()``: probabilities in [0, 1], no NaN)
        and the KL is finite. Inside jit bad inputs cannot raise; the stream is then garbage and this flag
        is the signal (a NaN/inf KL is partitioned as singletons, see :func:`sidejax.blocks.kl_blocks`).
    """

    kl_bits: jax.Array
    num_blocks: jax.Array
    num_fallback_blocks: jax.Array
    overflow: jax.Array
    statistic: jax.Array
    valid: jax.Array

    ideal_bits = kl_ideal_bits


class KLMSDecoded(NamedTuple):
    """What the server reads from one client's stream besides the sample.

    Attributes:
      starts: the client's block starts (its own partition in update rounds, else the broadcast one).
      num_blocks: blocks in the stream.
      statistic: the reported trigger statistic (0 in fixed mode).
      valid: the stream is well formed (``errors == 0``); a false flag means the sample is garbage.
      errors: int32 bitmask of what is wrong (``ERR_*``; :func:`stream_errors` turns it into text).
    """

    starts: jax.Array
    num_blocks: jax.Array
    statistic: jax.Array
    valid: jax.Array
    errors: jax.Array


class KLMSServerInfo(NamedTuple):
    """Server-side protocol diagnostics.

    Attributes:
      updated: this round was an update round (clients sent their partitions).
      next_update: the next round will be an update round.
      statistic: mean of the clients' statistics.
      num_blocks: blocks of the partition for the next round.
      streams_valid: bool ``[clients]``, one flag per participant in the order of the round's client ids:
        that client's stream was well formed (:attr:`KLMSDecoded.valid`). A false entry means that client's
        decoded sample, and everything aggregated from it this round, is garbage: a driver must stop the
        run and name the round and the client (``client_ids[i]`` for a false ``streams_valid[i]``).
      stream_errors: int32 ``[clients]``, each participant's :attr:`KLMSDecoded.errors` bitmask
        (:func:`stream_errors` gives the reasons).
    """

    updated: jax.Array
    next_update: jax.Array
    statistic: jax.Array
    num_blocks: jax.Array
    streams_valid: jax.Array
    stream_errors: jax.Array


def klms_init(dim: int, config: KLMSConfig, live=None) -> KLMSState:
    """Initial state: fixed blocks of ``config.block_size``; adaptive mode starts with an update round.

    ``live`` (Fixed mode only; an int32 scalar, traced or not, ``1 <= live <= dim``): code only the first
    ``live`` coordinates (:class:`sidejax.coding.LivePrefix`): the ``ceil(live / block_size)`` blocks that
    hold them are live, the last of them running to ``dim`` (the coordinates past ``live`` ride in it: a
    caller pads them with ``q = p``, which adds nothing to its log-weights), and every message is
    ``ceil(live / block_size) log2 K`` bits (+32 with the CRC), i.e. ``config.fixed_bits(live)``.
    """
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    mb = config.num_max_blocks(dim)
    coords = jnp.arange(dim)
    starts = coords % config.block_size == 0
    if live is not None:
        if config.adaptive:
            raise ValueError(
                "live: adaptive KLMS partitions the whole vector by its KL, so it cannot code a live prefix; "
                "use KLMSConfig(adaptive=False)"
            )
        if isinstance(live, int) and not 1 <= live <= dim:
            raise ValueError(f"live must be in 1..dim={dim}, got {live}")
        starts = starts & (coords < live)
    blocks = blocks_from_boundaries(starts, mb)
    return KLMSState(blocks, jnp.asarray(config.adaptive), jnp.asarray(False))


def _statistic(config: KLMSConfig, kl_total, block_kl, num_blocks):
    m = jnp.maximum(num_blocks, 1).astype(jnp.float32)
    if config.trigger == "thresholds":
        return kl_total / m
    live = jnp.arange(block_kl.shape[0]) < num_blocks
    rho = jnp.minimum(config.log2_num_candidates / jnp.maximum(block_kl, 1e-12), _RHO_CAP)
    return jnp.sum(jnp.where(live, rho, 0.0)) / m


def klms_encode(
    keys: ClientKeys, q, p, state: KLMSState, config: KLMSConfig
) -> tuple[Message, KLMSClientInfo]:
    """One client's KLMS message (Alg. 5, or Alg. 6 inside the update protocol).

    Args:
      keys: the client's keys for this round (shared: candidates; private: index choice).
      q: the client-only distribution over the flat vector (``dim`` coordinates).
      p: the shared prior, same type and shape.
      state: the broadcast :class:`KLMSState`.
      config: static settings.

    Returns:
      ``(message, info)``; ``message.num_bits`` is the stream's exact length and ``message.payload`` the
      static-capacity buffer (:meth:`KLMSConfig.capacity_words`), inside ``jit`` and outside it, of which
      only the first ``ceil(num_bits / 32)`` words are sent (the rest are zero;
      :func:`sidejax.coding.sent_message` cuts them).
    """
    blocks0 = state.blocks
    dim, mb = blocks0.dim, blocks0.max_blocks
    _check_dims(dim, q=q, p=p)
    b, L = config.log2_num_candidates, config.length_bits

    def encode(blocks, work_blocks):
        return encode_bounded(
            keys.shared,
            keys.private,
            q,
            p,
            blocks,
            log2_num_candidates=b,
            work_blocks=work_blocks,
            memory_budget_bytes=config.memory_budget_bytes,
        )

    def encode_bucketed(blocks, bucketed: bool):
        # lax.switch runs only the smallest bucket that holds blocks.num_blocks (when the count is not
        # batched; see KLMSConfig.bucket_update_rounds)
        buckets = config.work_buckets(dim) if bucketed else (mb,)
        if len(buckets) == 1:
            return encode(blocks, mb)
        branch = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), blocks.num_blocks, side="left")
        branch = jnp.minimum(branch, len(buckets) - 1)
        return jax.lax.switch(branch, [functools.partial(encode, blocks, w) for w in buckets])

    def encode_broadcast_partition():
        # the server's partition: its block count is the same for every client (not batched under vmap)
        return blocks0, encode_bucketed(blocks0, config.bucketed)

    if config.adaptive:
        kl = q.kl_bits(p)

        def repartition():
            blocks = kl_blocks(kl, config.target_bits, max_block_size=config.max_block_size, max_blocks=mb)
            return blocks, encode_bucketed(blocks, config.bucketed and config.bucket_update_rounds)

        blocks, (indices, info) = jax.lax.cond(state.update, repartition, encode_broadcast_partition)
    else:
        blocks, (indices, info) = encode_broadcast_partition()
    M = blocks.num_blocks
    live = jnp.arange(mb) < M
    words = jnp.zeros(config.capacity_words(dim), jnp.uint32)
    offset = jnp.int32(0)
    if config.adaptive:
        lengths = jnp.where(live & state.update, block_sizes(blocks) - 1, 0)
        words = pack_fixed(lengths, L, out=words)
        offset = jnp.where(state.update, M * L, 0)
    if b > 0:
        words = pack_fixed(jnp.where(live, indices, 0), b, bit_offset=offset, out=words)
        offset = offset + M * b
    stat = _statistic(config, info.kl_bits, info.block_kl_bits, M)
    if config.adaptive:
        word = jax.lax.bitcast_convert_type(stat.astype(jnp.float32), jnp.uint32)
        words = pack_fixed(word[None], 32, bit_offset=offset, out=words)
        offset = offset + 32
    if config.crc32:
        crc = stream_crc(keys.shared, p, words, offset)
        words = pack_fixed(crc[None], 32, bit_offset=offset, out=words)
        offset = offset + 32
    cinfo = KLMSClientInfo(
        kl_bits=info.kl_bits,
        num_blocks=M,
        num_fallback_blocks=info.num_fallback_blocks,
        overflow=blocks.overflow,
        statistic=stat,
        valid=is_valid(q) & is_valid(p) & jnp.isfinite(info.kl_bits),
    )
    return Message(payload=words, num_bits=as_bits(offset)), cinfo


def _check_dims(dim: int, **dists) -> None:
    check_dims(
        dim,
        "the KLMS state's blocks were built for",
        "build the state with klms_init({got}, config) (the flat vector's length), or pass the "
        "distributions of the vector the state was built for",
        **dists,
    )


def _blocks_from_lengths(words, bit_offset: int, dim: int, mb: int, L: int):
    """Parses block lengths minus one (``L`` bits each, from ``bit_offset``) until they cover ``dim``;
    returns ``(blocks, ok)`` with ``ok`` False when they do not sum to ``dim`` exactly."""
    lengths = unpack_fixed(words, mb, L, bit_offset=bit_offset).astype(jnp.int32) + 1
    cum = jnp.cumsum(lengths)
    M = jnp.minimum(jnp.searchsorted(cum, dim, side="left") + 1, mb).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), cum[:-1]])
    return blocks_from_starts(starts, M, dim, mb), cum[M - 1] == dim


def klms_decode(shared_key, p, state: KLMSState, message: Message, config: KLMSConfig):
    """The server's side for one client (Alg. 8): parse the stream, regenerate the chosen candidates.

    The receiver reads exactly the ``ceil(num_bits / 32)`` words that were sent and nothing else. The
    payload may be the encoder's static-capacity buffer (later words are zeroed before parsing) or exactly
    the words sent (:func:`sidejax.coding.sent_message`), and the decoder behaves the same inside ``jit``
    and outside it: it never raises on the stream's contents. A buffer shorter than ``num_bits`` claims,
    set bits past ``num_bits``, block lengths that do not sum to ``dim``, or fields that do not add up to
    ``num_bits`` give ``valid = False`` with the reasons in the ``errors`` bitmask (:func:`stream_errors`);
    the driver must check the flag (on the host, :func:`sidejax.coding.check_decoded` raises on it).

    Args:
      shared_key: the client's shared key (re-derived by the server from the round key and client id).
      p: the shared prior.
      state: the :class:`KLMSState` the client encoded against.
      message: the client's message.
      config: static settings.

    Returns:
      ``(sample[dim], KLMSDecoded)``.
    """
    blocks0 = state.blocks
    dim, mb = blocks0.dim, blocks0.max_blocks
    _check_dims(dim, p=p)
    b, L = config.log2_num_candidates, config.length_bits
    words, ok_length = received_words(message, config.capacity_words(dim))
    offset = jnp.int32(0)
    ok_partition = jnp.asarray(True)
    if config.adaptive:
        blocks, ok_partition = jax.lax.cond(
            state.update,
            lambda: _blocks_from_lengths(words, 0, dim, mb, L),
            lambda: (blocks0, jnp.asarray(True)),
        )
        offset = jnp.where(state.update, blocks.num_blocks * L, 0)
    else:
        blocks = blocks0
    M = blocks.num_blocks
    live = jnp.arange(mb) < M
    if b > 0:
        indices = unpack_fixed(words, mb, b, bit_offset=offset).astype(jnp.int32)
        indices = jnp.where(live, indices, 0)
        offset = offset + M * b
    else:
        indices = jnp.zeros(mb, jnp.int32)
    if config.adaptive:
        stat = jax.lax.bitcast_convert_type(unpack_fixed(words, 1, 32, bit_offset=offset)[0], jnp.float32)
        offset = offset + 32
    else:
        stat = jnp.float32(0.0)
    ok_crc = jnp.asarray(True)
    if config.crc32:
        sent = unpack_fixed(words, 1, 32, bit_offset=offset)[0]
        ok_crc = sent == stream_crc(shared_key, p, words, offset)
        offset = offset + 32
    ok_parse = offset == as_bits(message.num_bits)
    errors = failed_checks(
        length=ok_length, partition=ok_partition, parse=ok_parse, prior=is_valid(p), crc=ok_crc
    )
    valid = errors == 0
    sample = importance_decode(shared_key, p, blocks, indices)
    return sample, KLMSDecoded(blocks.starts, M, stat, valid, errors)


def klms_server_update(
    state: KLMSState, decoded: KLMSDecoded, config: KLMSConfig
) -> tuple[KLMSState, KLMSServerInfo]:
    """The server's protocol step, given every participant's :class:`KLMSDecoded` (stacked on axis 0).

    The returned :class:`KLMSServerInfo` carries ``streams_valid[clients]`` so that a driver can name the
    client whose stream was bad.
    """
    blocks = state.blocks
    dim, mb = blocks.dim, blocks.max_blocks
    valid, errors = jnp.asarray(decoded.valid, bool), jnp.asarray(decoded.errors, jnp.int32)
    if valid.ndim != 1:
        raise ValueError(
            "decoded must be stacked over the participating clients (axis 0), got valid of shape "
            f"{valid.shape}"
        )
    # the Coder contract: only the participants whose decoded.valid is True count (the mean statistic and
    # Alg. 7); with none the protocol state is kept
    stat = masked_mean(decoded.statistic, valid)
    if not config.adaptive:
        info = KLMSServerInfo(jnp.asarray(False), jnp.asarray(False), stat, blocks.num_blocks, valid, errors)
        return state._replace(changed=jnp.asarray(False)), info
    cap_bound = blocks.num_blocks <= -(-dim // config.max_block_size)
    if config.trigger == "thresholds":
        trigger = (stat > config.dbar_hi) | ((stat < config.dbar_lo) & ~cap_bound)
    else:
        trigger = (stat > config.rho_threshold) & ~cap_bound
    # Alg. 7 only after an update round (a real branch: the server step is not vmapped)
    new_blocks = jax.lax.cond(
        state.update,
        lambda: aggregate_block_locations(
            decoded.starts[:, :mb],
            jnp.where(valid, decoded.num_blocks, 0),
            dim=dim,
            max_block_size=config.max_block_size,
            max_blocks=mb,
        ),
        lambda: blocks,
    )
    next_update = jnp.where(state.update, False, trigger)
    new_state = keep_unless_none(valid, KLMSState(new_blocks, next_update, state.update), state)
    info = KLMSServerInfo(state.update, next_update, stat, new_state.blocks.num_blocks, valid, errors)
    return new_state, info


def klms_downlink(state: KLMSState, config: KLMSConfig) -> Message:
    """The protocol's downlink stream (what every client must know before encoding the next round).

    Adaptive mode: one bit, the ``update`` flag, then, after an update round (``state.changed``), the new
    partition as ``M`` block lengths minus one in ``log2(max_block_size)`` bits each (``1 + M L`` bits).
    The receiver knows whether the partition is present: ``changed`` is the ``update`` flag it received
    in the previous round. Fixed mode sends nothing (0 bits).
    """
    blocks = state.blocks
    mb = blocks.max_blocks
    if not config.adaptive:
        return Message(jnp.zeros((0,), jnp.uint32), as_bits(0))
    L = config.length_bits
    M = blocks.num_blocks
    live = jnp.arange(mb) < M
    words = jnp.zeros(-(-(1 + mb * L) // 32), jnp.uint32)
    words = pack_fixed(state.update.astype(jnp.uint32)[None], 1, out=words)
    lengths = jnp.where(live & state.changed, block_sizes(blocks) - 1, 0)
    words = pack_fixed(lengths, L, bit_offset=1, out=words)
    return Message(words, as_bits(1 + jnp.where(state.changed, M * L, 0)))


def klms_receive(state: KLMSState, message: Message, config: KLMSConfig) -> KLMSState:
    """The clients' side of :func:`klms_downlink`: the ``update`` flag and, when ``state.changed`` (known
    to the receiver from the previous round's flag), the partition, parsed from the stream's block lengths.
    ``state`` is the receiver's previous knowledge; its partition is kept when none was sent. The state
    returned is the receiver's knowledge for the next downlink too: its ``changed`` is the flag just
    received (whether the next downlink carries a partition), as in the server's state after its update
    (:func:`klms_server_update`), so a client that keeps it (a deployment's view,
    :mod:`sidejax.fl.roles`) parses the next partition without being handed the server's state."""
    if not config.adaptive:
        return state
    blocks = state.blocks
    dim, mb = blocks.dim, blocks.max_blocks
    L = config.length_bits
    cap = -(-(1 + mb * L) // 32)
    words = jnp.pad(jnp.asarray(message.payload, jnp.uint32), (0, max(0, cap - message.payload.shape[0])))
    words, _ = mask_to_length(words, message.num_bits)
    update = unpack_fixed(words, 1, 1)[0] > 0

    new_blocks = jax.lax.cond(
        state.changed, lambda: _blocks_from_lengths(words, 1, dim, mb, L)[0], lambda: blocks
    )
    return KLMSState(new_blocks, update, update)


def klms_frame(state: KLMSState, words: jax.Array, bit_offset, config: KLMSConfig) -> jax.Array:
    """The length in bits of the KLMS message that starts at bit ``bit_offset`` of ``words``, from the
    protocol state the receiver holds (the stream is self-delimiting, :attr:`sidejax.coding.Coder.frame`).

    Fixed mode and rounds without an update: ``M log2 K`` (+ 32 for the statistic in adaptive mode, + 32 for
    the CRC) with ``M`` the broadcast partition's block count. Update rounds: the block lengths at the start
    of the message are parsed until they cover ``dim``, which gives the client's ``M``.
    """
    blocks0 = state.blocks
    dim, mb = blocks0.dim, blocks0.max_blocks
    b, L = config.log2_num_candidates, config.length_bits
    tail = (32 if config.adaptive else 0) + (32 if config.crc32 else 0)
    words = jnp.asarray(words, jnp.uint32)
    if not config.adaptive:
        return as_bits(blocks0.num_blocks * b + tail)

    def parsed():
        blocks, _ = _blocks_from_lengths(words, bit_offset, dim, mb, L)
        return blocks.num_blocks * (L + b)

    head = jax.lax.cond(state.update, parsed, lambda: blocks0.num_blocks * b)
    return as_bits(head + tail)


def klms_coder(config: KLMSConfig) -> Coder:
    """The KLMS coder (:class:`sidejax.coding.Coder`): Fixed- or Adaptive-KLMS with the block-update protocol.

    ``config`` (K, the block sizes, the trigger) enters here once; the returned functions close over it.
    ``q`` and ``p`` are factorized distributions over the flat vector (:mod:`sidejax.distributions`).
    Fixed-KLMS declares a :attr:`sidejax.coding.Coder.live_prefix` (``klms_init(dim, config, live)``, in
    blocks of ``block_size``); Adaptive-KLMS, whose partition follows the whole vector's KL, declares none.
    """
    if not isinstance(config, KLMSConfig):
        raise TypeError(f"klms_coder needs a KLMSConfig, got {type(config).__name__}")
    return configured_coder(
        config,
        (klms_init, klms_encode, klms_decode, klms_server_update, klms_downlink, klms_receive, klms_frame),
        name="klms",
        deterministic=False,  # the candidates come from the shared key, the choice from the private one
        fixed_bits=None if config.adaptive else config.fixed_bits,
        live_prefix=None
        if config.adaptive
        else LivePrefix(lambda dim, live: klms_init(dim, config, live), config.block_size),
    )
