"""The counter-hash candidate generator (sidejax.coding.counter): a numpy oracle word for word, and a
statistical battery at fixed keys.

The battery (every bound is 6 standard errors of the statistic under an ideal generator, so with fixed keys
it is deterministic, and an ideal generator would fail one of its ~4,300 checks with probability ~1e-5):

- sample: ``K = 256`` candidates x ``16,384`` coordinates = 4,194,304 uniforms per key;
- per-bit balance of the 32-bit words (each bit's frequency of ones, SE ``0.5 / sqrt(n)``);
- a 1024-bin chi-square of the uniforms (df 1023; mean 1023, SD ``sqrt(2 * 1023)``), both tails;
- lag correlations along coordinates at lags 1, 2, 4, ..., 8192 (blocks are coordinate windows, so this
  is the correlation between blocks of every power-of-two size) and along candidates at lags 1..128
  (powers of two) (SE ``1 / sqrt(n_pairs)``);
- 2-D 32 x 32 chi-squares of neighbouring pairs: coordinates ``(j, j + 1)``, candidates ``(k, k + 1)``,
  and the same ``(k, j)`` under two clients' keys;
- correlations between the streams of 8 clients of one round (all 28 pairs) and of 8 consecutive rounds;
- the strict avalanche criterion: flipping any one input bit (of ``j``, ``k``, and each key word) flips
  each output bit with probability 1/2 (2^14 random inputs per input bit; 3,840 cells).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.coding.counter import (
    counter_uniforms,
    counter_words,
    grid_uniforms,
    key_words,
)
from sidejax.coding.importance import candidate_uniforms, chunk_uniforms
from sidejax.keys import client_keys, round_key, run_keys

K, D = 256, 16_384
N = K * D
SIGMAS = 6.0


def _mix(x):
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def oracle_words(w0, w1, k, j):
    """The formula of sidejax.coding.counter's docstring, in numpy uint32 (wrapping) arithmetic."""
    with np.errstate(over="ignore"):
        w0, w1 = np.uint32(w0), np.uint32(w1)
        a = _mix(_mix(np.asarray(j, np.uint32) ^ w0) + (w1 ^ np.uint32(0x7F4A7C15)))
        b = _mix(_mix((np.asarray(k, np.uint32) * np.uint32(0x9E3779B9)) ^ w1) + (w0 ^ np.uint32(0x3C6EF372)))
        return _mix(_mix(a ^ b) + b)


def _keys(n, parent=None):
    base = run_keys(0)[1] if parent is None else parent
    return [client_keys(round_key(base, 3), i).shared for i in range(n)]


@pytest.fixture(scope="module")
def grid():
    """``[K, D]`` words and uniforms of one client's shared key."""
    key = _keys(1)[0]
    words = jax.jit(lambda k: counter_words(k, jnp.arange(K)[:, None], jnp.arange(D)[None, :]))(key)
    return key, np.asarray(words), np.asarray(grid_uniforms(key, K, 0, D), np.float64)


def test_the_words_follow_the_documented_formula_bit_for_bit():
    rng = np.random.default_rng(0)
    k = rng.integers(0, 2**24, 5000)
    j = rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32)
    for key in [jax.random.key(0), jax.random.key(2**31 - 1), *_keys(3)]:
        w0, w1 = (int(w) for w in key_words(key))
        got = np.asarray(counter_words(key, jnp.asarray(k), jnp.asarray(j)))
        np.testing.assert_array_equal(got, oracle_words(w0, w1, k, j))
        # the uniform is the word's top 23 bits, centred: (floor(h / 2^9) + 0.5) / 2^23
        u = np.asarray(counter_uniforms(key, jnp.asarray(k), jnp.asarray(j)), np.float64)
        np.testing.assert_array_equal(u, ((got >> 9).astype(np.float64) + 0.5) / 2**23)


def test_grids_chunks_and_single_reads_agree(grid):
    key, words, u = grid
    # the encoder's chunks (any start, traced or not) and the decoder's single reads see the same uniforms
    for start, length in [(0, 7), (1, 64), (4093, 300), (D - 5, 5)]:
        window = u[:, start : start + length]
        np.testing.assert_array_equal(np.asarray(chunk_uniforms(key, K, start, length)), window)
        jitted = jax.jit(lambda s, n=length: grid_uniforms(key, K, s, n))(jnp.int32(start))
        np.testing.assert_array_equal(np.asarray(jitted), window)
    rows = np.array([0, 5, 255, 17])
    cols = np.array([0, 9000, 16383, 4])
    np.testing.assert_array_equal(np.asarray(candidate_uniforms(key, rows, cols)), u[rows, cols])


def test_keys_of_other_implementations_are_refused_by_name():
    with pytest.raises(ValueError, match="shared_key must be one Threefry-2x32 key.*rbg"):
        counter_uniforms(jax.random.key(0, impl="rbg"), jnp.arange(2), jnp.arange(2))
    # raw Threefry key data is the same key
    key = jax.random.key(7)
    np.testing.assert_array_equal(
        counter_uniforms(jax.random.key_data(key), jnp.arange(4), jnp.arange(4)),
        counter_uniforms(key, jnp.arange(4), jnp.arange(4)),
    )


def test_every_bit_is_balanced(grid):
    _, words, _ = grid
    ones = np.array([np.count_nonzero(words & np.uint32(1 << b)) for b in range(32)]) / N
    assert np.max(np.abs(ones - 0.5)) < SIGMAS * 0.5 / np.sqrt(N), ones


def _chi2_ok(counts):
    df = counts.size - 1
    expected = counts.sum() / counts.size
    chi2 = float(np.sum((counts - expected) ** 2) / expected)
    assert abs(chi2 - df) < SIGMAS * np.sqrt(2 * df), (chi2, df)


def test_the_uniforms_are_uniform(grid):
    _, _, u = grid
    assert u.min() > 0 and u.max() < 1
    _chi2_ok(np.bincount((u * 1024).astype(np.int64).ravel(), minlength=1024))
    assert abs(u.mean() - 0.5) < SIGMAS * np.sqrt(1 / 12 / N)


def _corr_ok(x, y):
    x, y = x.ravel() - 0.5, y.ravel() - 0.5
    r = float(np.mean(x * y) / (1 / 12))
    assert abs(r) < SIGMAS / np.sqrt(x.size), (r, x.size)


@pytest.mark.parametrize("lag", [2**s for s in range(14)])
def test_no_correlation_between_coordinates_or_blocks(grid, lag):
    _, _, u = grid
    _corr_ok(u[:, :-lag], u[:, lag:])


@pytest.mark.parametrize("lag", [2**s for s in range(8)])
def test_no_correlation_between_candidates(grid, lag):
    _, _, u = grid
    _corr_ok(u[:-lag], u[lag:])


def _pairs_ok(x, y):
    cells = (x * 32).astype(np.int64).ravel() * 32 + (y * 32).astype(np.int64).ravel()
    _chi2_ok(np.bincount(cells, minlength=1024))


def test_neighbours_are_independent_in_two_dimensions(grid):
    key, _, u = grid
    _pairs_ok(u[:, :-1], u[:, 1:])
    _pairs_ok(u[:-1], u[1:])
    other = np.asarray(grid_uniforms(_keys(2)[1], K, 0, D), np.float64)
    assert not np.array_equal(other, u)
    _pairs_ok(u, other)


def test_streams_of_clients_and_rounds_are_uncorrelated():
    n = 2**20
    base = run_keys(0)[1]
    clients = _keys(8)
    rounds = [client_keys(round_key(base, t), 0).shared for t in range(8)]
    draw = jax.jit(lambda k: grid_uniforms(k, 64, 0, n // 64))
    for family in (clients, rounds):
        streams = [np.asarray(draw(k), np.float64) for k in family]
        for a in range(len(streams)):
            for b in range(a + 1, len(streams)):
                _corr_ok(streams[a], streams[b])


def test_one_flipped_input_bit_flips_each_output_bit_half_the_time():
    """The strict avalanche criterion over (j, k, w0, w1), in the numpy oracle (bit-identical above)."""
    rng = np.random.default_rng(1)
    n = 2**14
    j = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    k = rng.integers(0, 2**24, n).astype(np.uint32)
    w0 = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    w1 = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    base = oracle_words(w0, w1, k, j)
    bits = np.uint32(1) << np.arange(32, dtype=np.uint32)
    for name, width in (("j", 32), ("k", 24), ("w0", 32), ("w1", 32)):
        for b in range(width):
            args = dict(w0=w0, w1=w1, k=k, j=j)
            args[name] = args[name] ^ np.uint32(1 << b)
            flipped = base ^ oracle_words(**args)
            rate = np.count_nonzero(flipped[:, None] & bits[None, :], axis=0) / n
            assert np.max(np.abs(rate - 0.5)) < SIGMAS * 0.5 / np.sqrt(n), (name, b, rate)


def test_every_backend_present_regenerates_the_same_candidates():
    """The words on every device kind present (the CPU always; a GPU or TPU where there is one) equal the
    numpy oracle's, and a Bernoulli stream decodes to the same mask on each: a client on one backend and a
    server on another agree. (On a CPU-only machine this checks the CPU; ``make gpu-check`` runs it on the
    accelerator.)"""
    from sidejax.blocks import fixed_blocks
    from sidejax.coding.importance import importance_decode
    from sidejax.distributions import Bernoulli

    key = _keys(1)[0]
    w0, w1 = (int(w) for w in key_words(key))
    k = np.arange(64)[:, None] * np.ones(4096, np.int64)[None, :]
    j = np.arange(4096)[None, :] * np.ones(64, np.int64)[:, None]
    want = oracle_words(w0, w1, k, j)
    dim = 4096
    probs = np.asarray(jax.random.uniform(jax.random.key(5), (dim,)), np.float32)
    indices = np.asarray(jax.random.randint(jax.random.key(6), (dim // 8,), 0, 64), np.int32)
    masks = []
    devices = {d.platform: d for d in [*jax.devices("cpu"), *jax.devices()]}
    for device in devices.values():
        with jax.default_device(device):
            got = jax.jit(counter_words)(key, jnp.asarray(k), jnp.asarray(j))
            assert got.devices() == {device}
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=device.platform)
            mask = importance_decode(
                key, Bernoulli(jnp.asarray(probs)), fixed_blocks(dim, 8), jnp.asarray(indices)
            )
            masks.append(np.asarray(mask))
    for mask in masks[1:]:
        np.testing.assert_array_equal(mask, masks[0])
