"""Block partitions (sidejax.blocks): KL-driven partitions against a numpy oracle, fixed blocks, and
Aggregate-Block-Locations (docs/papers/klms.md#s7-7, docs/papers/klms.md#s7-8).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.blocks import aggregate_block_locations, block_sizes, block_sums, fixed_blocks, kl_blocks

# The partitions run as jitted programs shared by the tests (one compile per static bound and shape), not op
# by op; kl_blocks is called eagerly only where its host-side check is the subject.
partition = jax.jit(kl_blocks, static_argnames=("target_bits", "max_block_size", "max_blocks"))
aggregate = jax.jit(aggregate_block_locations, static_argnames=("dim", "max_block_size", "max_blocks"))


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_partition_invariants(seed):
    rng = np.random.default_rng(seed)
    d, target, cap = 3000, 2.0, 64
    kl = rng.exponential(0.05, d) * (rng.random(d) < 0.7)
    kl[rng.integers(0, d, 5)] = 3.5  # single coordinates above target: overflow singletons
    b = partition(jnp.asarray(kl, jnp.float32), target, max_block_size=cap, max_blocks=d)
    m = int(b.num_blocks)
    starts = np.asarray(b.starts)[: m + 1]
    sizes = np.diff(starts)
    assert starts[0] == 0 and starts[-1] == d and (sizes >= 1).all() and (sizes <= cap).all()
    assert not bool(b.overflow)
    ids = np.asarray(b.block_ids)
    assert (np.diff(ids) >= 0).all() and ids[-1] == m - 1
    bkl = np.array([kl[s:e].sum() for s, e in zip(starts[:-1], starts[1:], strict=True)])
    over = bkl > target + 1e-4
    assert (sizes[over] == 1).all() and over.sum() == 5
    assert m >= math.ceil(kl.sum() / target)
    # maximality: each non-final block closed because of the cap or because the next coordinate overflows
    nxt = np.array([kl[e] if e < d else 0 for e in starts[1:]])
    assert ((sizes == cap) | (bkl + nxt > target - 1e-4) | (starts[1:] == d)).all()


def _chain_starts(cum, target, cap, max_blocks):
    """Numpy oracle of the reference rule: follow block ends from 0, one block at a time."""
    d, s, starts = len(cum) - 1, 0, []
    while s < d and len(starts) < max_blocks:
        starts.append(s)
        j = np.searchsorted(cum, np.float32(cum[s] + np.float32(target)), side="right")
        s = min(max(s + 1, j - 1), s + cap, d)
    return starts, s < d


def test_kl_partition_matches_chain_oracle_and_vmap():
    """Pointer doubling gives exactly the block-by-block chain (on the same float32 cumulative KL), also
    when ``max_blocks`` truncates it, and vmapping over clients changes nothing."""
    rng = np.random.default_rng(7)
    d, cap, target = 1500, 32, 2.5
    kls = np.stack([rng.exponential(s, d) * (rng.random(d) < 0.8) for s in (0.02, 0.3, 3.0)]).astype(
        np.float32
    )
    for max_blocks in (d, 40):
        f = functools.partial(kl_blocks, target_bits=target, max_block_size=cap, max_blocks=max_blocks)
        batched = jax.jit(jax.vmap(f))(jnp.asarray(kls))
        for c in range(3):
            cum = np.concatenate([[0], np.asarray(jnp.cumsum(jnp.asarray(kls[c])))]).astype(np.float32)
            starts, overflow = _chain_starts(cum, target, cap, max_blocks)
            m = int(batched.num_blocks[c])
            assert m == len(starts) and np.asarray(batched.starts[c])[:m].tolist() == starts
            assert bool(batched.overflow[c]) == overflow
            ids = np.searchsorted(np.array(starts), np.arange(d), side="right") - 1
            assert np.array_equal(np.asarray(batched.block_ids[c]), ids)
        # d / cap > 40: a bound of 40 blocks truncates every client (flagged), a bound of d none
        assert np.asarray(batched.overflow).tolist() == [max_blocks == 40] * 3


def test_kl_partition_edge_cases():
    b = partition(jnp.zeros(1000), 2.0, max_block_size=256, max_blocks=1000)
    assert np.asarray(block_sizes(b))[: int(b.num_blocks)].tolist() == [256, 256, 256, 232]
    eps = 0.03
    b = partition(jnp.full(1000, eps), 2.0, max_block_size=256, max_blocks=1000)
    assert int(block_sizes(b)[0]) == min(256, math.floor(2.0 / eps))
    b = partition(jnp.full(100, 1.0), 2.0, max_block_size=256, max_blocks=10)
    assert bool(b.overflow)  # needs 50 blocks, bound is 10: flagged, not silent
    with pytest.raises(ValueError, match="target_bits"):
        kl_blocks(jnp.zeros(4), 0.0, max_block_size=2, max_blocks=4)
    with pytest.raises(ValueError, match="target_bits"):
        partition(jnp.zeros(4), 0.0, max_block_size=2, max_blocks=4)


def test_kl_partition_isolates_non_finite_kl_in_and_out_of_jit():
    """Regression (issue 12): one NaN in the per-coordinate KL poisoned the cumulative sum and made every
    later block cap-sized, silently. The coordinate becomes a singleton block (like a KL above the target)
    and the rest of the partition is unchanged, eagerly as in jit (the encoder flags the client invalid)."""
    d, cap = 400, 64
    kl = np.full(d, 0.25, np.float32)
    part = lambda k: partition(k, 2.0, max_block_size=cap, max_blocks=d)
    for bad in (float("nan"), float("inf")):
        got = part(jnp.asarray(kl).at[100].set(bad))
        eager = kl_blocks(jnp.asarray(kl).at[100].set(bad), 2.0, max_block_size=cap, max_blocks=d)
        assert all(
            np.array_equal(a, b) for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(got), strict=True)
        )
        ref = part(jnp.asarray(kl).at[100].set(5.0))  # same program, a finite KL above the target
        assert np.array_equal(np.asarray(got.starts), np.asarray(ref.starts))
        sizes = np.asarray(block_sizes(got))[: int(got.num_blocks)]
        assert sizes.max() == 8 and 1 in sizes  # blocks of 2 bits of KL (8 coordinates), one singleton


def test_fixed_blocks():
    b = fixed_blocks(10, 4)
    assert np.asarray(b.starts).tolist() == [0, 4, 8, 10] and int(b.num_blocks) == 3
    assert np.asarray(b.block_ids).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    np.testing.assert_allclose(block_sums(jnp.ones(10), b), [4, 4, 2])


def test_aggregate_block_locations():
    d, cap = 500, 32
    kl = jnp.asarray(np.random.default_rng(3).exponential(0.1, d), jnp.float32)
    b = partition(kl, 2.0, max_block_size=cap, max_blocks=d)
    st = jnp.stack([b.starts] * 3)
    agg = aggregate(st, jnp.stack([b.num_blocks] * 3), dim=d, max_block_size=cap, max_blocks=d)
    assert np.array_equal(agg.starts, b.starts) and int(agg.num_blocks) == int(b.num_blocks)  # idempotent
    # hand-computed Alg. 7: client A starts [0, 3, 10], client B [0, 5] -> [0, ceil(8/2)=4, 10]; cap 4 splits
    hand = aggregate(
        jnp.array([[0, 3, 10], [0, 5, 13]]), jnp.array([3, 2]), dim=13, max_block_size=4, max_blocks=13
    )
    assert np.asarray(hand.starts)[: int(hand.num_blocks) + 1].tolist() == [0, 4, 8, 10, 13]
    # exact integer ceil-mean past float32's 2**24: float32 reads 2**24 + 1 as 2**24 and would give 2**24 + 1
    big = 2**24 + 8
    exact = aggregate(
        jnp.array([[0, 2**24 + 1], [0, 2**24 + 2]]),
        jnp.array([2, 2]),
        dim=big,
        max_block_size=2**25,
        max_blocks=4,
    )
    assert np.asarray(exact.starts)[:3].tolist() == [0, 2**24 + 2, big]
    # random clients: strictly increasing, within [0, d], no block over the cap
    rng = np.random.default_rng(4)
    parts = [
        partition(jnp.asarray(rng.exponential(s, d), jnp.float32), 2.0, max_block_size=cap, max_blocks=d)
        for s in (0.01, 0.1, 0.5)
    ]
    out = aggregate(
        jnp.stack([p.starts for p in parts]),
        jnp.stack([p.num_blocks for p in parts]),
        dim=d,
        max_block_size=cap,
        max_blocks=d,
    )
    s = np.asarray(out.starts)[: int(out.num_blocks) + 1]
    assert s[0] == 0 and s[-1] == d and (np.diff(s) > 0).all() and (np.diff(s) <= cap).all()
