"""KLMS coding core: distributions, block partitions, the importance-sampling coder, bit packing.

Statistical tests use fixed keys and n independent blocks of size 1 per encoder call, so tolerances are a
few standard errors of n draws; closed forms or float64 numpy are the references (spec klms.md §7).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import binom

from sidejax.bits import LN2
from sidejax.blocks import (
    aggregate_block_locations,
    block_sizes,
    block_sums,
    fixed_blocks,
    kl_blocks,
)
from sidejax.coding.base import Message
from sidejax.coding.bitstream import check_stream, pack_fixed, unpack_fixed
from sidejax.coding.importance import (
    _pair_uniforms,
    candidate_uniforms,
    candidates,
    decode_indices,
    encode_indices,
    importance_decode,
    importance_encode,
)
from sidejax.distributions import Bernoulli, DiagGaussian, Sign, Ternary

SK, PK = jax.random.key(11), jax.random.key(12)


def _encode_decode(q, p, blocks, log2k, shared=SK, private=PK, chunk_size=None):
    idx, info = importance_encode(
        shared, private, q, p, blocks, log2_num_candidates=log2k, chunk_size=chunk_size
    )
    return idx, info, importance_decode(shared, p, blocks, idx)


encode_decode = jax.jit(_encode_decode, static_argnames=("log2k", "chunk_size"))


def singletons(n):
    return fixed_blocks(n, 1)


# ----------------------------------------------------------------------------------------------------
# distributions and KL (spec item 6)


def test_kl_formulas():
    phi = jnp.array([0.2, 0.5, 0.9, 0.01, 0.99])
    theta = jnp.array([0.5, 0.5, 0.1, 0.99, 0.01])
    kl = np.asarray(Bernoulli(phi).kl_nats(Bernoulli(theta)), np.float64)
    f, t = np.asarray(phi, np.float64), np.asarray(theta, np.float64)
    ref = f * np.log(f / t) + (1 - f) * np.log((1 - f) / (1 - t))
    np.testing.assert_allclose(kl, ref, rtol=1e-5)
    assert kl[1] == 0 and (kl >= 0).all() and np.isfinite(kl).all()  # clipped to [0.01, 0.99]: finite
    np.testing.assert_allclose(Bernoulli(phi).kl_bits(Bernoulli(theta)), kl / LN2, rtol=1e-6)
    g = DiagGaussian(jnp.array([0.8, -1.0]), jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(g.kl_nats(DiagGaussian(jnp.zeros(2), g.scale)), [0.32, 0.125], rtol=1e-6)
    qt = np.array([[0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    pt = np.array([[1 / 3] * 3, [0.25, 0.5, 0.25]])
    direct = [
        sum(a * math.log(a / b) for a, b in zip(qr, pr, strict=True) if a > 0)
        for qr, pr in zip(qt, pt, strict=True)
    ]
    np.testing.assert_allclose(Ternary(jnp.asarray(qt)).kl_nats(Ternary(jnp.asarray(pt))), direct, rtol=1e-5)
    np.testing.assert_allclose(Sign(phi).kl_nats(Sign(theta)), kl, rtol=1e-6)


def test_constructors_validate():
    with pytest.raises(ValueError, match="probs"):
        Bernoulli.create([0.5, 1.2])
    with pytest.raises(ValueError, match="probs"):
        Ternary.create([[0.5, 0.5, 0.5]])
    with pytest.raises(ValueError, match="scale"):
        DiagGaussian.create([0.0], [0.0])


@pytest.mark.parametrize("bad", [1.5, -0.2, float("nan")])
def test_distributions_reject_bad_parameters_on_the_host_and_flag_them_in_jit(bad):
    """Regression (issue 12): Bernoulli([.., 1.5]) (or -0.2, NaN) built silently and gave a NaN rate and a
    collapsed partition downstream. Concrete values raise naming the argument; traced ones are flagged by
    is_valid(); rebuilding from leaves (tree.map) does not re-check."""
    probs = np.array([0.5, bad, 0.2], np.float32)
    for cls in (Bernoulli, Sign):
        with pytest.raises(ValueError, match=f"{cls.__name__} probs must hold probabilities in \\[0, 1\\]"):
            cls(jnp.asarray(probs))
        with pytest.raises(ValueError, match=f"{cls.__name__} probs"):
            cls(probs.tolist())
        assert not bool(jax.jit(lambda a, cls=cls: cls(a).is_valid())(jnp.asarray(probs)))
        assert bool(jax.jit(lambda a, cls=cls: cls(a).is_valid())(jnp.full(3, 0.3)))
    tern = np.array([[0.2, 0.3, 0.5], [bad, 0.5, 0.5 - bad]], np.float32)
    with pytest.raises(ValueError, match="Ternary probs"):
        Ternary(jnp.asarray(tern))
    assert not bool(jax.jit(lambda a: Ternary(a).is_valid())(jnp.asarray(tern)))
    with pytest.raises(ValueError, match="DiagGaussian scale"):
        DiagGaussian(jnp.zeros(3), jnp.asarray([1.0, bad - 1.5, 1.0]))  # 0, -1.7 or NaN
    with pytest.raises(ValueError, match="DiagGaussian loc"):
        DiagGaussian(jnp.asarray([0.0, float("inf"), 0.0]), jnp.ones(3))
    g = jax.jit(lambda s: DiagGaussian(jnp.zeros(3), s).is_valid())
    assert not bool(g(jnp.asarray([1.0, bad - 1.5, 1.0]))) and bool(g(jnp.ones(3)))
    # pytree utilities rebuild without checking (their leaves need not be probabilities)
    scaled = jax.tree.map(lambda a: a * 3, Bernoulli(jnp.full(2, 0.5)))
    assert isinstance(scaled, Bernoulli) and float(scaled.probs[0]) == 1.5


def test_icdf_sampling_matches_means():
    u = (jnp.arange(100000) + 0.5) / 100000  # a quasi-uniform grid: exact frequencies
    np.testing.assert_allclose(Bernoulli(jnp.full(1, 0.3)).icdf(u[:, None]).mean(), 0.3, atol=1e-5)
    t = Ternary(jnp.array([[0.2, 0.5, 0.3]]))
    np.testing.assert_allclose(t.icdf(u[:, None]).mean(), 0.1, atol=1e-5)
    assert float(t.log_prob(jnp.array([1.0]))[0]) == pytest.approx(math.log(0.3), rel=1e-6)


# ----------------------------------------------------------------------------------------------------
# partitions (items 7, 8)


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_partition_invariants(seed):
    rng = np.random.default_rng(seed)
    d, target, cap = 3000, 2.0, 64
    kl = rng.exponential(0.05, d) * (rng.random(d) < 0.7)
    kl[rng.integers(0, d, 5)] = 3.5  # single coordinates above target: overflow singletons
    b = jax.jit(lambda k: kl_blocks(k, target, max_block_size=cap, max_blocks=d))(
        jnp.asarray(kl, jnp.float32)
    )
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
    b = kl_blocks(jnp.zeros(1000), 2.0, max_block_size=256, max_blocks=1000)
    assert np.asarray(block_sizes(b))[: int(b.num_blocks)].tolist() == [256, 256, 256, 232]
    eps = 0.03
    b = kl_blocks(jnp.full(1000, eps), 2.0, max_block_size=256, max_blocks=1000)
    assert int(block_sizes(b)[0]) == min(256, math.floor(2.0 / eps))
    b = kl_blocks(jnp.full(100, 1.0), 2.0, max_block_size=256, max_blocks=10)
    assert bool(b.overflow)  # needs 50 blocks, bound is 10: flagged, not silent
    with pytest.raises(ValueError, match="target_bits"):
        kl_blocks(jnp.zeros(4), 0.0, max_block_size=2, max_blocks=4)


def test_kl_partition_rejects_non_finite_kl_and_isolates_it_in_jit():
    """Regression (issue 12): one NaN in the per-coordinate KL poisoned the cumulative sum and made every
    later block cap-sized, silently. On the host it raises; in jit the coordinate becomes a singleton block
    (like a KL above the target) and the rest of the partition is unchanged."""
    d, cap = 400, 64
    kl = np.full(d, 0.25, np.float32)
    part = jax.jit(lambda k: kl_blocks(k, 2.0, max_block_size=cap, max_blocks=d))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kl_bits has 1 non-finite entries .*coordinate 100"):
            kl_blocks(jnp.asarray(kl).at[100].set(bad), 2.0, max_block_size=cap, max_blocks=d)
        got = part(jnp.asarray(kl).at[100].set(bad))
        ref = part(jnp.asarray(kl).at[100].set(5.0))  # same program, a finite KL above the target
        assert np.array_equal(np.asarray(got.starts), np.asarray(ref.starts))
        sizes = np.asarray(block_sizes(got))[: int(got.num_blocks)]
        assert sizes.max() == 8 and 1 in sizes  # blocks of 2 bits of KL (8 coordinates), one singleton


def test_wrong_dimension_is_a_clear_error():
    """Regression (issue 12): blocks built for another dimension failed deep inside JAX (shape errors in
    dynamic_slice / gather); now a ValueError names both dimensions."""
    b = fixed_blocks(100, 10)
    q, p = Bernoulli(jnp.full(101, 0.3)), Bernoulli(jnp.full(101, 0.5))
    with pytest.raises(ValueError, match="q has 101 coordinates but the blocks were built for dim=100"):
        importance_encode(SK, PK, q, p, b, log2_num_candidates=2)
    with pytest.raises(ValueError, match="p has 101 coordinates but the blocks were built for dim=100"):
        importance_decode(SK, p, b, jnp.zeros(10, jnp.int32))


def test_fixed_blocks():
    b = fixed_blocks(10, 4)
    assert np.asarray(b.starts).tolist() == [0, 4, 8, 10] and int(b.num_blocks) == 3
    assert np.asarray(b.block_ids).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    np.testing.assert_allclose(block_sums(jnp.ones(10), b), [4, 4, 2])


def test_aggregate_block_locations():
    d, cap = 500, 32
    kl = jnp.asarray(np.random.default_rng(3).exponential(0.1, d), jnp.float32)
    b = kl_blocks(kl, 2.0, max_block_size=cap, max_blocks=d)
    st = jnp.stack([b.starts] * 3)
    agg = aggregate_block_locations(
        st, jnp.stack([b.num_blocks] * 3), dim=d, max_block_size=cap, max_blocks=d
    )
    assert np.array_equal(agg.starts, b.starts) and int(agg.num_blocks) == int(b.num_blocks)  # idempotent
    # hand-computed Alg. 7: client A starts [0, 3, 10], client B [0, 5] -> [0, ceil(8/2)=4, 10]; cap 4 splits
    hand = aggregate_block_locations(
        jnp.array([[0, 3, 10], [0, 5, 13]]), jnp.array([3, 2]), dim=13, max_block_size=4, max_blocks=13
    )
    assert np.asarray(hand.starts)[: int(hand.num_blocks) + 1].tolist() == [0, 4, 8, 10, 13]
    # exact integer ceil-mean past float32's 2**24: float32 reads 2**24 + 1 as 2**24 and would give 2**24 + 1
    big = 2**24 + 8
    exact = aggregate_block_locations(
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
        kl_blocks(jnp.asarray(rng.exponential(s, d), jnp.float32), 2.0, max_block_size=cap, max_blocks=d)
        for s in (0.01, 0.1, 0.5)
    ]
    out = aggregate_block_locations(
        jnp.stack([p.starts for p in parts]),
        jnp.stack([p.num_blocks for p in parts]),
        dim=d,
        max_block_size=cap,
        max_blocks=d,
    )
    s = np.asarray(out.starts)[: int(out.num_blocks) + 1]
    assert s[0] == 0 and s[-1] == d and (np.diff(s) > 0).all() and (np.diff(s) <= cap).all()


# ----------------------------------------------------------------------------------------------------
# the coder: exactness and bits (items 1, 2, 19)


def test_decoder_reproduces_encoder_choice_for_any_partition_and_chunking():
    d = 777
    q = Bernoulli(jax.random.uniform(jax.random.key(1), (d,), minval=0.02, maxval=0.98))
    p = Bernoulli(jnp.full((d,), 0.4))
    y_all = candidates(SK, p, 3)
    # the encoder's chunk windows hash exactly the candidates' uniforms (integer hashing: exact in any
    # program), so the candidates do not depend on chunking
    u_all = candidate_uniforms(SK, jnp.arange(8)[:, None], jnp.arange(d)[None, :])
    for start, length in ((0, 2), (100, 100), (700, 76)):
        assert np.array_equal(_pair_uniforms(SK, 8, start, length), u_all[:, start : start + length])
    for blocks in (fixed_blocks(d, 16), kl_blocks(q.kl_bits(p), 3.0, max_block_size=64, max_blocks=d)):
        ref = None
        for chunk in (2, 100, None):
            idx, _, y = encode_decode(q, p, blocks, 3, chunk_size=chunk)
            # the decoded sample is the chosen candidate (discrete values: exact across programs)
            assert np.array_equal(y, y_all[idx[blocks.block_ids], jnp.arange(d)])
            ref = idx if ref is None else ref
            # each chunking is another compiled program whose per-block log-weights are summed in another
            # order (last-bit differences), so an index may flip where two candidates' perturbed
            # log-weights tie to rounding; bit equality is only demanded within one program (below)
            assert np.mean(np.asarray(idx) == np.asarray(ref)) >= 0.95
        idx_nojit, _ = importance_encode(SK, PK, q, p, blocks, log2_num_candidates=3, chunk_size=100)
        assert np.mean(np.asarray(idx_nojit) == np.asarray(ref)) >= 0.95
        again, _, _ = encode_decode(q, p, blocks, 3, chunk_size=None)  # same program: bit for bit
        assert np.array_equal(again, ref)


def test_bits_are_the_packed_stream_length_and_round_trip():
    d = 300
    q = Ternary(jax.nn.softmax(jax.random.normal(jax.random.key(2), (d, 3)), axis=-1))
    p = Ternary(jnp.full((d, 3), 1 / 3))
    blocks = kl_blocks(q.kl_bits(p), 4.0, max_block_size=32, max_blocks=d)
    idx, _, y = encode_decode(q, p, blocks, 4)
    msg = encode_indices(idx, blocks.num_blocks, 4)
    assert float(msg.num_bits) == int(blocks.num_blocks) * 4
    assert np.array_equal(decode_indices(msg, blocks.max_blocks, 4), idx)
    assert np.array_equal(importance_decode(SK, p, blocks, decode_indices(msg, blocks.max_blocks, 4)), y)
    with pytest.raises(ValueError, match="truncated"):
        decode_indices(Message(msg.payload[:3], msg.num_bits), blocks.max_blocks, 4)
    with pytest.raises(ValueError, match="truncated"):
        check_stream(msg.num_bits - 1, msg.num_bits)
    with pytest.raises(ValueError, match="log2_num_candidates"):
        importance_encode(SK, PK, q, p, blocks, log2_num_candidates=2.5)


@pytest.mark.parametrize("width", [1, 3, 8, 13, 32])
def test_bit_packing_round_trip(width):
    v = np.random.default_rng(width).integers(0, 2**width, 77, dtype=np.uint64).astype(np.uint32)
    words = pack_fixed(jnp.asarray(v), width)
    assert words.shape == (-(-77 * width // 32),)
    assert np.array_equal(unpack_fixed(words, 77, width), v)


def test_crc32_matches_zlib():
    """The vectorised CRC-32 equals zlib.crc32 on the same little-endian bytes, for every prefix length."""
    import zlib

    from sidejax.coding.bitstream import crc32_words

    w = np.random.default_rng(5).integers(0, 2**32, 40, dtype=np.uint64).astype(np.uint32)
    f = jax.jit(crc32_words)
    got = [int(f(jnp.asarray(w), n)) for n in (0, 1, 2, 3, 7, 31, 40)]
    want = [zlib.crc32(w[:n].astype("<u4").tobytes()) for n in (0, 1, 2, 3, 7, 31, 40)]
    assert got == want
    assert int(crc32_words(jnp.asarray(w[:5]))) == zlib.crc32(w[:5].astype("<u4").tobytes())  # eager, all


def test_vmap_over_clients_equals_stack():
    d = 64
    qs = Bernoulli(jax.random.uniform(jax.random.key(3), (3, d), minval=0.05, maxval=0.95))
    p = Bernoulli(jnp.full((d,), 0.5))
    b = fixed_blocks(d, 8)
    sks = jax.vmap(lambda i: jax.random.fold_in(SK, i))(jnp.arange(3))
    pks = jax.vmap(lambda i: jax.random.fold_in(PK, i))(jnp.arange(3))
    f = lambda s, r, q: importance_encode(s, r, q, p, b, log2_num_candidates=2, chunk_size=16)[0]

    @jax.jit
    def both(sks, pks, qs):  # one compiled program: batched and per-client encodes must agree bit for bit
        return jax.vmap(f)(sks, pks, qs), [f(sks[i], pks[i], Bernoulli(qs.probs[i])) for i in range(3)]

    batched, single = both(sks, pks, qs)
    for i in range(3):
        assert np.array_equal(batched[i], single[i])


# ----------------------------------------------------------------------------------------------------
# statistics (items 3, 4, 5, 9, 10)

N_STAT = 40000


def bernoulli_is_law(phi, theta, K):
    """Closed form P(Y = 1) of the single-coordinate coder (spec §7 item 9), in float64."""
    j = np.arange(K + 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = j * phi / theta
        frac = np.where(j > 0, a / (a + (K - j) * (1 - phi) / (1 - theta)), 0.0)
    return float(np.sum(binom.pmf(j, K, theta) * frac))


def test_closed_form_matches_spec_table():
    assert bernoulli_is_law(0.8, 0.5, 4) == pytest.approx(0.736126, abs=1e-6)
    assert bernoulli_is_law(0.1, 0.3, 64) == pytest.approx(0.10136, abs=1e-5)
    assert bernoulli_is_law(0.8, 0.5, 1024) == pytest.approx(0.799812, abs=1e-6)


@pytest.mark.parametrize("phi, theta", [(0.8, 0.5), (0.1, 0.3)])
@pytest.mark.parametrize("log2k", [0, 1, 2, 3, 4])
def test_single_coordinate_bernoulli_coder_exact_law(phi, theta, log2k):
    q, p = Bernoulli(jnp.full(N_STAT, phi)), Bernoulli(jnp.full(N_STAT, theta))
    _, info, y = encode_decode(q, p, singletons(N_STAT), log2k, shared=jax.random.key(100 + log2k))
    expected = bernoulli_is_law(phi, theta, 2**log2k)
    se = math.sqrt(expected * (1 - expected) / N_STAT)
    assert abs(float(y.mean()) - expected) < 4.5 * se
    assert int(info.num_fallback_blocks) == 0


@pytest.mark.parametrize("log2k", [0, 3])
def test_q_equal_p_gives_samples_of_p(log2k):
    theta = jnp.full(N_STAT, 0.3)
    _, _, y = encode_decode(Bernoulli(theta), Bernoulli(theta), fixed_blocks(N_STAT, 4), log2k)
    se = math.sqrt(0.3 * 0.7 / N_STAT)
    assert abs(float(y.mean()) - 0.3) < 4.5 * se


def test_zero_probability_candidates_are_never_chosen_and_fallback_is_counted():
    n = 2000
    # q puts no mass on -1: any candidate with a -1 in the block has weight 0
    q = Ternary(jnp.tile(jnp.array([[0.0, 0.5, 0.5]]), (n, 1)))
    p = Ternary(jnp.tile(jnp.array([[0.3, 0.4, 0.3]]), (n, 1)))
    _, info, y = encode_decode(q, p, fixed_blocks(n, 2), 4)
    fallback = int(info.num_fallback_blocks)
    assert np.isfinite(np.asarray(y)).all()
    # P(all 16 candidates of a 2-coordinate block contain a -1) = (1 - 0.49)^16 ~ 2e-5: essentially never
    assert (np.asarray(y) >= 0).all() and fallback == 0
    # q with all mass on -1 where p has none: every block falls back, and it is counted
    q2 = Ternary(jnp.tile(jnp.array([[1.0, 0.0, 0.0]]), (n, 1)))
    p2 = Ternary(jnp.tile(jnp.array([[0.0, 0.5, 0.5]]), (n, 1)))
    _, info2, y2 = encode_decode(q2, p2, fixed_blocks(n, 2), 2)
    assert int(info2.num_fallback_blocks) == n // 2 and np.isfinite(np.asarray(y2)).all()


def test_gaussian_bias_shrinks_with_k():
    """q = N(0.8, 1), p = N(0, 1): self-normalised IS is biased towards p for small K (spec item 10)."""
    q, p = (
        DiagGaussian(jnp.full(N_STAT, 0.8), jnp.ones(N_STAT)),
        DiagGaussian(jnp.zeros(N_STAT), jnp.ones(N_STAT)),
    )
    means = []
    for log2k in (0, 1, 2, 4, 7):
        _, _, y = encode_decode(q, p, singletons(N_STAT), log2k, shared=jax.random.key(200 + log2k))
        means.append(float(y.mean()))
    se = 1.0 / math.sqrt(N_STAT)
    assert abs(means[0]) < 4.5 * se  # K = 1: exactly p
    assert all(b > a - 3 * se for a, b in zip(means, means[1:], strict=False))  # monotone within noise
    assert abs(0.8 - means[-1]) < 0.03  # K = 128: r = ln 128 - 0.32 = 4.5 nats
    assert means[1] == pytest.approx(0.326, abs=0.03) and means[2] == pytest.approx(0.524, abs=0.03)


def test_uniforms_are_strictly_inside_the_unit_interval():
    from sidejax.distributions import bits_to_open_uniform

    extremes = bits_to_open_uniform(jnp.array([0, 2**32 - 1], jnp.uint32))
    assert 0.0 < float(extremes[0]) and float(extremes[1]) < 1.0
    assert np.isfinite(DiagGaussian(jnp.zeros(2), jnp.ones(2)).icdf(extremes)).all()
