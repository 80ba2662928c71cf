"""The importance-sampling coder (sidejax.coding.importance): exactness, bits, and its statistics.

Statistical tests use fixed keys and n independent blocks of size 1 per encoder call, so tolerances are a
few standard errors of n draws; closed forms or float64 numpy are the references (docs/papers/klms.md#s7-1 to
docs/papers/klms.md#s7-5, docs/papers/klms.md#s7-9, docs/papers/klms.md#s7-10, docs/papers/klms.md#s7-19).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import binom

from sidejax.blocks import fixed_blocks, kl_blocks
from sidejax.coding.base import Message
from sidejax.coding.bitstream import check_stream
from sidejax.coding.importance import (
    candidate_uniforms,
    candidates,
    chunk_uniforms,
    decode_indices,
    encode_indices,
    importance_decode,
    importance_encode,
)
from sidejax.distributions import Bernoulli, DiagGaussian, Ternary

SK, PK = jax.random.key(11), jax.random.key(12)


def _encode_decode(q, p, blocks, log2k, shared=SK, private=PK, chunk_size=None):
    idx, info = importance_encode(
        shared, private, q, p, blocks, log2_num_candidates=log2k, chunk_size=chunk_size
    )
    return idx, info, importance_decode(shared, p, blocks, idx)


# Compiling is most of this module's time: the tests share jitted programs (one compile per static
# argument and shape) instead of running the coder's helpers op by op.
encode_decode = jax.jit(_encode_decode, static_argnames=("log2k", "chunk_size"))
decode = jax.jit(importance_decode)


@functools.partial(jax.jit, static_argnames=("target_bits", "max_block_size"))
def kl_partition(q, p, *, target_bits, max_block_size):
    """The KL-driven partition of ``q`` against ``p``, bounded by ``dim`` blocks."""
    kl = q.kl_bits(p)
    return kl_blocks(kl, target_bits, max_block_size=max_block_size, max_blocks=kl.shape[0])


def singletons(n):
    return fixed_blocks(n, 1)


def test_wrong_dimension_is_a_clear_error():
    """Regression (issue 12): blocks built for another dimension failed deep inside JAX (shape errors in
    dynamic_slice / gather); now a ValueError names both dimensions."""
    b = fixed_blocks(100, 10)
    q, p = Bernoulli(jnp.full(101, 0.3)), Bernoulli(jnp.full(101, 0.5))
    with pytest.raises(ValueError, match="q has 101 coordinates but the blocks were built for dim=100"):
        importance_encode(SK, PK, q, p, b, log2_num_candidates=2)
    with pytest.raises(ValueError, match="p has 101 coordinates but the blocks were built for dim=100"):
        importance_decode(SK, p, b, jnp.zeros(10, jnp.int32))


WINDOWS = ((0, 2), (100, 100), (700, 76))


@jax.jit
def _candidate_tables(p):
    """The K = 8 candidates of every coordinate of ``p``, their uniforms, and the encoder's chunk windows of
    those uniforms (:data:`WINDOWS`)."""
    d = p.probs.shape[0]
    u_all = candidate_uniforms(SK, jnp.arange(8)[:, None], jnp.arange(d)[None, :])
    return candidates(SK, p, 3), u_all, [chunk_uniforms(SK, 8, start, length) for start, length in WINDOWS]


def test_decoder_reproduces_encoder_choice_for_any_partition_and_chunking():
    d = 777
    q = Bernoulli(jax.random.uniform(jax.random.key(1), (d,), minval=0.02, maxval=0.98))
    p = Bernoulli(jnp.full((d,), 0.4))
    y_all, u_all, windows = (np.asarray(a) if not isinstance(a, list) else a for a in _candidate_tables(p))
    # the encoder's chunk windows hash exactly the candidates' uniforms (integer hashing: exact in any
    # program), so the candidates do not depend on chunking
    for (start, length), window in zip(WINDOWS, windows, strict=True):
        assert np.array_equal(window, u_all[:, start : start + length])
    for blocks in (fixed_blocks(d, 16), kl_partition(q, p, target_bits=3.0, max_block_size=64)):
        ref = None
        block_ids = np.asarray(blocks.block_ids)
        for chunk in (2, 100, None):
            idx, _, y = encode_decode(q, p, blocks, 3, chunk_size=chunk)
            # the decoded sample is the chosen candidate (discrete values: exact across programs)
            assert np.array_equal(y, y_all[np.asarray(idx)[block_ids], np.arange(d)])
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
    blocks = kl_partition(q, p, target_bits=4.0, max_block_size=32)
    idx, _, y = encode_decode(q, p, blocks, 4)
    msg = encode_indices(idx, blocks.num_blocks, 4)
    assert float(msg.num_bits) == int(blocks.num_blocks) * 4
    assert np.array_equal(decode_indices(msg, blocks.max_blocks, 4), idx)
    assert np.array_equal(decode(SK, p, blocks, decode_indices(msg, blocks.max_blocks, 4)), y)
    with pytest.raises(ValueError, match="truncated"):
        decode_indices(Message(msg.payload[:3], msg.num_bits), blocks.max_blocks, 4)
    with pytest.raises(ValueError, match="truncated"):
        check_stream(msg.num_bits - 1, msg.num_bits)
    with pytest.raises(ValueError, match="log2_num_candidates"):
        importance_encode(SK, PK, q, p, blocks, log2_num_candidates=2.5)


def test_vmap_over_clients_equals_stack():
    d = 64
    qs = Bernoulli(jax.random.uniform(jax.random.key(3), (3, d), minval=0.05, maxval=0.95))
    p = Bernoulli(jnp.full((d,), 0.5))
    b = fixed_blocks(d, 8)
    f = lambda s, r, q: importance_encode(s, r, q, p, b, log2_num_candidates=2, chunk_size=16)[0]

    @jax.jit
    def both(qs):  # one compiled program: batched and per-client encodes must agree bit for bit
        sks = jax.vmap(lambda i: jax.random.fold_in(SK, i))(jnp.arange(3))
        pks = jax.vmap(lambda i: jax.random.fold_in(PK, i))(jnp.arange(3))
        return jax.vmap(f)(sks, pks, qs), [f(sks[i], pks[i], Bernoulli(qs.probs[i])) for i in range(3)]

    batched, single = both(qs)
    for i in range(3):
        assert np.array_equal(batched[i], single[i])


N_STAT = 40000


def bernoulli_is_law(phi, theta, K):
    """Closed form P(Y = 1) of the single-coordinate coder (docs/papers/klms.md#s7-9), in float64."""
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
    """q = N(0.8, 1), p = N(0, 1): self-normalised IS is biased towards p for small K
    (docs/papers/klms.md#s7-10)."""
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
