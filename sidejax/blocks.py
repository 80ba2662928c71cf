"""Block partitions of a flat parameter vector for the importance-sampling coder (KLMS,
docs/papers/klms.md#s3-2).

A :class:`Blocks` is a static-shape description of ``num_blocks`` contiguous blocks covering ``[0, dim)``:
``starts[m]`` is the first coordinate of block m for ``m < num_blocks`` and ``starts[m] = dim`` beyond, and
``block_ids[j]`` is the block of coordinate j. ``max_blocks`` (the length of ``starts`` minus one) is a
static bound, so partitions computed inside ``jit`` keep fixed shapes.

- :func:`fixed_blocks`: blocks of size S (Fixed-KLMS, Alg. 5).
- :func:`kl_blocks`: the KL-adaptive partition (Adaptive-KLMS, Alg. 6), the deterministic reference rule
  [R] of docs/papers/klms.md#s3-3: a block closes before coordinate i when adding it would push the block's KL
  over the target, or when the block has ``max_block_size`` coordinates; a single coordinate whose KL alone
  exceeds the target forms an *overflow* singleton. It runs inside jit without a data-dependent loop: one
  ``searchsorted`` on the cumulative KL gives every coordinate's next block start, and pointer doubling
  follows that chain from 0 (``O(dim log max_blocks)``, the same cost under ``vmap`` over clients).
- :func:`aggregate_block_locations`: Alg. 7 (element-wise ceil-mean of the clients' block starts) with the
  [R] post-processing of docs/papers/klms.md#s3-4: strictly increasing, clipped to [0, dim], first start 0,
  blocks longer than the cap split.

Deviation: cumulative KL is accumulated in float32, so for very long vectors (millions of coordinates) a
block boundary can move by one coordinate relative to exact arithmetic (block KL may exceed the target by
the float32 rounding of the running sum, ~1e-7 relative).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax.utils import check_number

__all__ = [
    "Blocks",
    "blocks_from_starts",
    "blocks_from_boundaries",
    "fixed_blocks",
    "kl_blocks",
    "block_sizes",
    "block_sums",
    "aggregate_block_locations",
]


class Blocks(NamedTuple):
    """A partition of ``[0, dim)`` into contiguous blocks.

    Attributes:
      block_ids: int32 ``[dim]``, nondecreasing, ``block_ids[j] < num_blocks``.
      starts: int32 ``[max_blocks + 1]``; ``starts[m]`` for ``m < num_blocks`` are the block starts
        (``starts[0] = 0``), and every later entry is ``dim``.
      num_blocks: int32 scalar, the number of live blocks.
      overflow: bool scalar, True if the partition needed more than ``max_blocks`` blocks and the tail was
        merged into the last block (never silent: check it).
    """

    block_ids: jax.Array
    starts: jax.Array
    num_blocks: jax.Array
    overflow: jax.Array

    @property
    def dim(self) -> int:
        return self.block_ids.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.starts.shape[0] - 1


def blocks_from_boundaries(is_start: jax.Array, max_blocks: int) -> Blocks:
    """Builds :class:`Blocks` from a boolean ``[dim]`` mask of block starts (``is_start[0]`` is forced on)."""
    dim = is_start.shape[0]
    is_start = is_start.at[0].set(True)
    block_ids = jnp.cumsum(is_start.astype(jnp.int32)) - 1
    num = jnp.sum(is_start.astype(jnp.int32))
    overflow = num > max_blocks
    block_ids = jnp.minimum(block_ids, max_blocks - 1)
    (positions,) = jnp.nonzero(is_start, size=max_blocks, fill_value=dim)
    starts = jnp.concatenate([positions.astype(jnp.int32), jnp.array([dim], jnp.int32)])
    return Blocks(
        block_ids.astype(jnp.int32), starts, jnp.minimum(num, max_blocks).astype(jnp.int32), overflow
    )


def blocks_from_starts(starts: jax.Array, num_blocks: jax.Array, dim: int, max_blocks: int) -> Blocks:
    """Builds :class:`Blocks` from a start list (entries at positions ``>= num_blocks`` are ignored)."""
    live = jnp.arange(starts.shape[0]) < num_blocks
    idx = jnp.where(live, starts, dim)
    mask = jnp.zeros(dim, bool).at[idx].set(True, mode="drop")
    return blocks_from_boundaries(mask, max_blocks)


def fixed_blocks(dim: int, block_size: int) -> Blocks:
    """Blocks ``[mS, min((m+1)S, dim))``: ``ceil(dim / S)`` blocks, the last possibly shorter (Alg. 5)."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    max_blocks = -(-dim // block_size)
    return blocks_from_boundaries(jnp.arange(dim) % block_size == 0, max_blocks)


def kl_blocks(kl_bits: jax.Array, target_bits: float, *, max_block_size: int, max_blocks: int) -> Blocks:
    """The KL-adaptive partition (KLMS Alg. 6 with the [R] reference rule of docs/papers/klms.md#s3-3), inside
    jit.

    Block ``[s, e)`` ends at the smallest ``e > s`` such that ``sum(kl[s:e+1]) > target_bits`` or
    ``e - s == max_block_size`` (or ``e == dim``). Invariants: the blocks tile ``[0, dim)``,
    ``1 <= size <= max_block_size``, and a block's KL is at most the target unless it is a singleton whose
    own KL exceeds it; the number of blocks is at least ``ceil(sum(kl) / target)``.

    Non-finite KL (NaN or inf) cannot be partitioned: each non-finite coordinate is treated as above the
    target, inside ``jit`` and outside it alike, so it becomes its own singleton block and the other blocks
    are unaffected (without this a NaN poisons the cumulative sum and every later block comes out
    cap-sized); the caller must flag it: :func:`sidejax.coding.klms.klms_encode` reports ``valid = False``.

    Args:
      kl_bits: float ``[dim]``, per-coordinate KL in bits (nonnegative, finite).
      target_bits: target KL per block, in bits (``log2 K`` in KLMS).
      max_block_size: the cap ``MAX_BLOCK_SIZE`` (static).
      max_blocks: static bound on the number of blocks (``dim`` is always enough).

    Returns:
      :class:`Blocks` (check ``overflow``: True if more than ``max_blocks`` blocks were needed).
    """
    if max_block_size < 1:
        raise ValueError(f"max_block_size must be >= 1, got {max_block_size}")
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    check_number(target_bits, "target_bits", "a number > 0 (the KL target of a block)", lambda x: x > 0)
    if jnp.ndim(kl_bits) != 1:
        raise ValueError(f"kl_bits must be a 1-D [dim] array, got shape {jnp.shape(kl_bits)}")
    dim = kl_bits.shape[0]
    kl = kl_bits.astype(jnp.float32)
    kl = jnp.where(jnp.isfinite(kl), kl, 2 * jnp.asarray(target_bits, jnp.float32))  # singleton (see above)
    cum = jnp.concatenate([jnp.zeros(1, jnp.float32), jnp.cumsum(kl)])  # [dim + 1]
    # nxt[s]: where a block starting at s ends (= the next start); nxt[dim] = dim is the fixed point
    s = jnp.arange(dim + 1, dtype=jnp.int32)
    j = jnp.searchsorted(cum, cum + target_bits, side="right")  # first j with cum[j] > cum[s] + t
    e = jnp.maximum(s + 1, j - 1)
    nxt = jnp.minimum(jnp.minimum(e, s + max_block_size), dim).astype(jnp.int32)
    # starts[n] = nxt^n(0) for n = 0..max_blocks by pointer doubling: level k applies nxt^(2^k) where bit k
    # of n is set. O((dim + max_blocks) log max_blocks) gathers and no data-dependent loop, so it stays
    # linear-log under vmap (a while_loop with a batched predicate would select its whole carry per step).
    n = jnp.arange(max_blocks + 1, dtype=jnp.int32)

    def level(carry, k):
        x, f = carry
        x = jnp.where((n >> k) & 1 == 1, f[x], x)
        return (x, f[f]), None

    levels = max(1, int(max_blocks).bit_length())
    (x, _), _ = jax.lax.scan(
        level, (jnp.zeros(max_blocks + 1, jnp.int32), nxt), jnp.arange(levels, dtype=jnp.int32)
    )
    num = jnp.sum(x[:max_blocks] < dim).astype(jnp.int32)
    blocks = blocks_from_starts(x[:max_blocks], num, dim, max_blocks)
    return blocks._replace(overflow=blocks.overflow | (x[max_blocks] < dim))


def block_sizes(blocks: Blocks) -> jax.Array:
    """int32 ``[max_blocks]``: the size of each block (0 for dead slots)."""
    return jnp.diff(blocks.starts)


def block_sums(values: jax.Array, blocks: Blocks) -> jax.Array:
    """``[max_blocks]`` per-block sums of ``values[dim]`` (segment sum)."""
    return jax.ops.segment_sum(
        values, blocks.block_ids, num_segments=blocks.max_blocks, indices_are_sorted=True
    )


def aggregate_block_locations(
    starts: jax.Array, num_blocks: jax.Array, *, dim: int, max_block_size: int, max_blocks: int
) -> Blocks:
    """Aggregate-Block-Locations (KLMS Alg. 7) with the [R] post-processing of docs/papers/klms.md#s3-4.

    ``ibar_m = ceil(mean over clients with at least m+1 blocks of their m-th start)``; then starts that are
    not strictly greater than all previous ones are dropped, the first start is 0, and any block longer than
    ``max_block_size`` is split into pieces of ``max_block_size`` (the last shorter). Identical inputs are
    returned unchanged.

    Args:
      starts: int ``[clients, L]``: each client's block starts (entries ``>= num_blocks[c]`` ignored).
      num_blocks: int ``[clients]``.
      dim: vector length (static).
      max_block_size: the cap (static).
      max_blocks: static bound on the output's number of blocks.
    """
    valid = jnp.arange(starts.shape[1])[None, :] < num_blocks[:, None]
    count = jnp.sum(valid, axis=0)
    # exact integer ceil-mean: with n = count, sum_c s_c = n * sum_c (s_c // n) + sum_c (s_c % n), so
    # ceil(mean) = sum_c (s_c // n) + ceil(sum_c (s_c % n) / n); int32 never exceeds dim + n**2 (a float32
    # sum would round once clients * dim passes 2**24)
    n = jnp.maximum(count, 1)  # [M], broadcasts over the clients axis of s
    s = jnp.where(valid, starts, 0).astype(jnp.int32)
    ibar = jnp.sum(s // n, axis=0) + (jnp.sum(s % n, axis=0) + n - 1) // n
    ibar = jnp.where(count > 0, jnp.clip(ibar, 0, dim), dim)
    prev_max = jnp.concatenate([jnp.array([-1], jnp.int32), jax.lax.cummax(ibar)[:-1]])
    keep = (ibar > prev_max) & (ibar < dim) & (count > 0)
    mask = jnp.zeros(dim, bool).at[jnp.where(keep, ibar, dim)].set(True, mode="drop").at[0].set(True)
    # split blocks longer than the cap: a coordinate starts a block when its offset from the last kept
    # start is a multiple of max_block_size
    pos = jnp.arange(dim)
    last_start = jax.lax.cummax(jnp.where(mask, pos, 0))
    mask = mask | ((pos - last_start) % max_block_size == 0)
    return blocks_from_boundaries(mask, max_blocks)
