"""CEPAM's coders (sidejax/coding/lattice.py): the full encode -> bitstream -> decode pipeline.

- the decoded error passes KS tests against N(0, σ²) (Z^1, Z^2, Z^3, E8) and Lap(0, b) (Z^1) for inputs far
  from the origin, on lattice points and random, and is uncorrelated with the input;
- the trial indices are geometric with the acceptance probabilities of docs/papers/cepam.md#s2-5 (χ² goodness
  of fit);
- the decoder reproduces the encoder's reconstruction bit for bit (one program), a wrong key does not;
- the two-phase vector quantizer returns the per-block reference loop's (h, coords) bit for bit;
- the stream parses back exactly, corrupted or truncated streams are flagged, overflow is reported;
- the normalise / clip pre-processing, per-client noise levels (NoisePrior), the additive-noise and SDQ
  baselines, padding when n does not divide d, and bad input.

Fixed keys throughout: every statistic is deterministic, and the KS floor P_MIN is far below the p-values
of a correct law at these sizes."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from sidejax import lattices as L
from sidejax.coding import lrsuq as Q
from sidejax.coding.base import float32_coder
from sidejax.coding.lattice import (
    NoisePrior,
    _lrsuq_quantize_blocks,
    _straggler_plan,
    additive_noise_coder,
    clip_update,
    decode_lattice_stream,
    encode_lattice_stream,
    lattice_blocks,
    lattice_stream_capacity_words,
    lrsuq_coder,
    lrsuq_quantize,
    num_blocks,
    sdq_coder,
    trial_golomb_parameter,
    trial_index_capacity_bits,
)
from sidejax.distributions import PointMass
from sidejax.keys import client_keys, lattice_keys, round_key

D = 12_001  # coordinates per message (= iid error samples, Lemma 11); not a multiple of 2, 3 or 8: padded
P_MIN = 1e-3
SIGMA = 0.5
B = 0.3
CAP = 48  # bits per coordinate: inputs 1e3 away from the origin need ~25


def _keys(seed: int, client: int = 0):
    return client_keys(round_key(jax.random.key(seed), 0), client)


def _inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "random": rng.normal(0.0, 1.0, D),
        "far": 1e3 * np.sign(rng.normal(size=D)) + rng.normal(0.0, 3.0, D),
        "on-lattice": rng.integers(-4, 5, D).astype(np.float64),  # integer points of Z^n (and of D8 ⊂ E8)
    }


@functools.cache
def _pipeline(lattice: L.Lattice, noise):
    """One compiled program per (lattice, noise), shared by the law, padding, NaN and overflow tests: encode x
    with the coder (center 0), decode the message; also the trial indices of the vector quantizer on its own
    in the same program."""
    coder = lrsuq_coder(lattice, noise, capacity_bits_per_coordinate=CAP)

    @jax.jit
    def run(keys, x):
        p = PointMass(jnp.zeros_like(x))
        message, info = coder.encode(keys, PointMass(x), p, coder.init(x.shape[0]))
        y, decoded = coder.decode(keys.shared, p, coder.init(x.shape[0]), message)
        h, _ = lrsuq_quantize(keys.shared, x, lattice, noise)
        return y, decoded.errors, info.valid, message.num_bits, h, info.overflow

    return run


GAUSS = [
    L.integer_lattice(1),
    L.integer_lattice(2),
    L.integer_lattice(3),
    pytest.param(L.e8(), marks=pytest.mark.slow),  # 10.5 s from an empty compilation cache
]
PACKING = {"Z^1": 1.0, "Z^2": math.pi / 4, "Z^3": math.pi / 6, "E8": math.pi**4 / 384}


@pytest.mark.parametrize("lattice", GAUSS, ids=lambda lat: lat.name)
def test_gaussian_pipeline_error_law_and_trials(lattice):
    run = _pipeline(lattice, Q.GaussianNoise(SIGMA))
    trials = []
    for seed, (kind, x) in enumerate(_inputs(1).items()):
        x = jnp.asarray(x, jnp.float32)
        y, errors, valid, num_bits, h, _ = run(_keys(seed), x)
        assert int(errors) == 0 and bool(valid), kind
        err = np.asarray(y, np.float64) - np.asarray(x, np.float64)
        # float32 rounding of |x| ~ 1e3 adds ~6e-5 to an error of scale 0.5: far below what KS resolves
        assert stats.kstest(err / SIGMA, "norm").pvalue > P_MIN, kind
        if kind != "on-lattice":
            assert abs(np.corrcoef(err, np.asarray(x))[0, 1]) < 4.0 / math.sqrt(D), kind
        assert float(num_bits) > 0
        trials.append(np.asarray(h))
    h = np.concatenate(trials)
    p = PACKING[lattice.name]
    assert Q.acceptance_probability(lattice, Q.GaussianNoise(SIGMA)) == pytest.approx(p, rel=1e-12)
    if p == 1.0:
        assert np.all(h == 1)
        return
    # χ² goodness of fit of h against Geom(p), tail pooled where the expected count drops below 20
    n = h.size
    top = 1
    while n * (1 - p) ** top * p >= 20:
        top += 1
    observed = np.array([np.sum(h == i) for i in range(1, top)] + [np.sum(h >= top)])
    expected = np.array([n * (1 - p) ** (i - 1) * p for i in range(1, top)] + [n * (1 - p) ** (top - 1)])
    assert stats.chisquare(observed, expected).pvalue > P_MIN
    assert abs(h.mean() - 1 / p) < 5 * math.sqrt((1 - p) / p**2 / n)


def test_laplace_pipeline_error_law():
    lattice = L.integer_lattice(1)
    run = _pipeline(lattice, Q.LaplaceNoise(B))
    for seed, (kind, x) in enumerate(_inputs(2).items()):
        x = jnp.asarray(x, jnp.float32)
        y, errors, valid, _, h, _ = run(_keys(10 + seed), x)
        assert int(errors) == 0 and bool(valid) and np.all(np.asarray(h) == 1), kind
        err = np.asarray(y, np.float64) - np.asarray(x, np.float64)
        assert stats.kstest(err, "laplace", args=(0.0, B)).pvalue > P_MIN, kind


def test_decoder_reproduces_the_encoder_bit_for_bit_and_a_wrong_key_does_not():
    lattice, noise = L.integer_lattice(2), Q.GaussianNoise(0.1)
    coder = lrsuq_coder(lattice, noise)
    d = 301  # odd: the last block is padded

    @jax.jit
    def both(keys, other_shared, x):
        p = PointMass(jnp.zeros_like(x))
        message, _ = coder.encode(keys, PointMass(x), p, coder.init(d))
        y, decoded = coder.decode(keys.shared, p, coder.init(d), message)
        wrong, _ = coder.decode(other_shared, p, coder.init(d), message)
        # the encoder's own reconstruction: beta (M_h + V_h) computed inside the rejection loop
        xb = jnp.pad(x, (0, 1)).reshape(-1, 2)
        enc = jax.vmap(lambda j, b: Q._lrsuq_encode(keys.shared, j, b, lattice, noise)[2])(
            jnp.arange(xb.shape[0]), xb
        )
        return y, decoded.errors, wrong, enc.reshape(-1)[:d]

    x = jnp.asarray(np.random.default_rng(3).normal(0, 0.05, d), jnp.float32)
    y, errors, wrong, enc = both(_keys(0), _keys(0, client=1).shared, x)
    assert int(errors) == 0
    np.testing.assert_array_equal(np.asarray(y), np.asarray(enc))
    assert np.mean(np.asarray(wrong) != np.asarray(y)) > 0.9


@pytest.mark.parametrize(
    "lattice",
    [
        L.integer_lattice(2),
        # the same two-phase code at other block dimensions (5-16 s each to compile): slow
        pytest.param(L.integer_lattice(3), marks=pytest.mark.slow),
        pytest.param(L.d4(), marks=pytest.mark.slow),
        pytest.param(L.e8(), marks=pytest.mark.slow),  # 16 s from an empty cache
    ],
    ids=lambda lat: lat.name,
)
def test_two_phase_quantizer_matches_the_plain_loop_bit_for_bit(lattice):
    """lrsuq_quantize (T0 trials for all blocks, then the stragglers gathered into `cap` slots) returns
    exactly the (h, coords) of the per-block reference loop, with its own plan, with a tiny cap that forces
    many gather rounds, with T0 past every h (no stragglers), and under an outer vmap over two keys; blocks
    that cannot be encoded (NaN, beyond the int32 range) keep h = 0."""
    noise = Q.GaussianNoise(0.1)
    d = 2_001
    blocks = num_blocks(d, lattice)
    t0, cap = _straggler_plan(Q.acceptance_probability(lattice, noise), blocks)
    assert 1 <= t0 and 64 <= cap <= blocks

    @jax.jit
    def run(key, other, x):
        xb = lattice_blocks(x, lattice)
        index = jnp.arange(blocks)
        ref = jax.vmap(lambda j, b: Q._lrsuq_encode(key, j, b, lattice, noise)[:2])(index, xb)
        plans = [
            _lrsuq_quantize_blocks(lattice_keys(key), xb, lattice, noise, None, t, c)
            for t, c in ((1, 2), (64, 1))
        ]
        batched = jax.vmap(lambda k: lrsuq_quantize(k, x, lattice, noise))(jnp.stack([key, other]))
        ref_other = jax.vmap(lambda j, b: Q._lrsuq_encode(other, j, b, lattice, noise)[:2])(index, xb)
        return ref, lrsuq_quantize(key, x, lattice, noise), plans, batched, ref_other

    x = np.random.default_rng(9).normal(0.0, 0.3, d)
    x[5] = np.nan
    x[-1] = 1e12  # x/β beyond the int32 coordinate range
    key, other = _keys(0).shared, _keys(0, client=1).shared
    (h, c), own, plans, (bh, bc), (oh, oc) = run(key, other, jnp.asarray(x, jnp.float32))
    h, c = np.asarray(h), np.asarray(c)
    assert h[5 // lattice.dim] == 0 and h[-1] == 0 and np.sum(h == 0) == 2
    assert np.sum(h > 1) > 2  # the tiny cap (2 slots) needs several gather rounds
    assert h.max() > t0  # the plan's own straggler phase runs
    for hj, cj in (own, *plans):
        np.testing.assert_array_equal(np.asarray(hj), h)
        np.testing.assert_array_equal(np.asarray(cj), c)
    np.testing.assert_array_equal(np.asarray(bh), np.stack([h, np.asarray(oh)]))
    np.testing.assert_array_equal(np.asarray(bc), np.stack([c, np.asarray(oc)]))


def test_straggler_plan():
    """The documented plans at d = 25,818 and cap = min(N, ceil(2 N (1 - p)^T0) + 64)."""
    d = 25_818
    expected = {"Z^1": 1, "Z^2": 2, "Z^3": 4, "A2": 1, "D4": 3, "E8": 9}
    for lat in (
        L.integer_lattice(1),
        L.integer_lattice(2),
        L.integer_lattice(3),
        L.hexagonal(),
        L.d4(),
        L.e8(),
    ):
        p, blocks = Q.acceptance_probability(lat, Q.GaussianNoise(1.0)), num_blocks(d, lat)
        t0, cap = _straggler_plan(p, blocks)
        assert t0 == expected[lat.name], lat.name
        assert cap == min(blocks, math.ceil(2 * blocks * (1 - p) ** t0) + 64), lat.name
    assert _straggler_plan(1.0, 10) == (1, 10)


# (blocks, n, trial_m, p): the stream tests' one shape, Z^3's trials (p = π/6, Golomb parameter 1)
STREAM = (500, 3, 1, math.pi / 6)


@functools.cache
def _stream_codec():
    """The stream encoder and decoder at :data:`STREAM`, compiled once for the stream tests; the buffer holds
    4 bits per coordinate and the trial indices' 1e-18 quantile at p."""
    blocks, n, m, p = STREAM
    cap = lattice_stream_capacity_words(blocks, n, m, 4, acceptance=p)
    encode = jax.jit(functools.partial(encode_lattice_stream, trial_m=m, capacity_words=cap))
    decode = jax.jit(functools.partial(decode_lattice_stream, blocks=blocks, n=n, trial_m=m))
    return encode, decode, cap


def _chernoff_quotient_bound(blocks: int, quotient_p: float, eps: float = 1e-18) -> int:
    """Oracle: the smallest t with the Chernoff bound on P(S >= t + 1) <= eps, S ~ NB(blocks, quotient_p)
    (E e^{sS} = (p'/(1 - (1 - p') e^s))^N, minimised at e^s = t/((N + t)(1 - p')))."""
    q = 1.0 - quotient_p
    t = math.ceil(blocks * q / quotient_p)
    while True:
        es = (t + 1) / ((blocks + t + 1) * q)
        if es > 1 and blocks * math.log(quotient_p / (1 - q * es)) - (t + 1) * math.log(es) <= math.log(eps):
            return t
        t += 1


def test_trial_index_capacity_from_the_negative_binomial_tail():
    """T is the exact 1e-18 quantile of the quotient sum NB(N, 1 - (1 - p)^m), below the Chernoff bound and
    far below the former 64 bits per block; the default (no p) bounds every p with that m; a stream at the
    bound fits, one past the buffer is reported, not truncated."""
    for blocks, p in ((12_909, math.pi / 4), (8_606, math.pi / 6), (3_228, math.pi**4 / 384), (1, 0.25367)):
        m = trial_golomb_parameter(p)
        qp = 1.0 - (1.0 - p) ** m
        bits = trial_index_capacity_bits(blocks, m, p)
        t = bits - blocks * (1 + (m - 1).bit_length())
        assert stats.nbinom.sf(t, blocks, qp) <= 1e-18 < stats.nbinom.sf(t - 1, blocks, qp)
        assert blocks * (1 - qp) / qp < t <= _chernoff_quotient_bound(blocks, qp)
        if blocks > 1:
            assert t < 0.1 * 64 * blocks  # the former slack: 64 quotient bits per block
        for other in np.linspace(0.05, 0.999, 60):  # every p with the same parameter m: below the default
            if trial_golomb_parameter(other) == m:
                assert trial_index_capacity_bits(blocks, m, float(other)) <= trial_index_capacity_bits(
                    blocks, m
                )
    assert trial_index_capacity_bits(5, 1, 1.0) == 5
    # the bound is reached: quotient sum exactly T fits the coder's buffer, a stream past the buffer does not
    encode, _, cap = _stream_codec()
    blocks, n, m, p = STREAM
    t = trial_index_capacity_bits(blocks, m, p) - blocks
    coords = jnp.zeros((blocks, n), jnp.int32)
    h = jnp.ones((blocks,), jnp.int32).at[0].set(1 + t)
    _, _, fits = encode(h, coords)
    assert bool(fits)
    _, nb, fits = encode(h.at[1].set(1 + 32 * cap), coords)
    assert not bool(fits) and float(nb) > 32 * (cap - 1)
    for bad in ((0, 1, None), (3, 0, None), (3, 1, 0.0), (3, 1, 1.5)):
        with pytest.raises(ValueError, match="blocks|trial_m|acceptance"):
            trial_index_capacity_bits(*bad)


@pytest.mark.parametrize(
    "trial_m",
    [
        # no trials and Golomb-2 trials: make test-all (8 s each cold); the symbols are the unary case's
        pytest.param(0, marks=pytest.mark.slow),
        1,
        pytest.param(2, marks=pytest.mark.slow),
    ],
    ids=["no-trials", "unary", "golomb2"],
)
def test_stream_round_trip_and_corruption(trial_m):
    """Trial indices (none, unary as on Z^2..D4, Golomb m = 2 as on E8) and coordinates, some with
    magnitudes past 255 (written as two codewords), round-trip; the walk (CPU) and the pointer-doubling jump
    (accelerators) decode every stream, intact or corrupted, to the same values and error flags; truncated,
    padded and flipped streams are flagged."""
    rng = np.random.default_rng(4 + trial_m)
    blocks, n = 200, 3
    p = {0: 1.0, 1: math.pi / 6, 2: 0.25367}[trial_m]
    assert trial_golomb_parameter(p) == trial_m
    h = jnp.asarray(rng.geometric(p, blocks), jnp.int32)
    coords = rng.integers(-3, 4, (blocks, n)) * (rng.uniform(size=(blocks, n)) < 0.2)
    coords[rng.integers(0, blocks, 6), rng.integers(0, n, 6)] = [300, -1000, 2**20, -(2**30), 256, 70_000]
    coords = jnp.asarray(coords, jnp.int32)
    cap = lattice_stream_capacity_words(blocks, n, trial_m, 16, acceptance=p if trial_m else None)
    words, nb, fits = jax.jit(functools.partial(encode_lattice_stream, trial_m=trial_m, capacity_words=cap))(
        h, coords
    )
    assert bool(fits)
    walk, jump = (
        jax.jit(functools.partial(decode_lattice_stream, blocks=blocks, n=n, trial_m=trial_m, method=m))
        for m in ("walk", "jump")
    )
    h2, c2, err = walk(words, nb)
    assert int(err) == 0
    np.testing.assert_array_equal(np.asarray(h2), np.asarray(h) if trial_m else np.ones(blocks))
    np.testing.assert_array_equal(np.asarray(c2), np.asarray(coords))
    # truncated by one bit, padded by one bit, a flipped bit inside the header
    for bad_nb in (nb - 1, nb + 1):
        assert int(walk(words, bad_nb)[2]) != 0
    flipped = words.at[0].set(words[0] ^ jnp.uint32(1))
    out = walk(flipped, nb)
    assert int(out[2]) != 0 or not np.array_equal(np.asarray(out[0]), np.asarray(h))
    # both chain methods agree on every stream, random bit flips included
    used = int(nb) // 32 + 1
    streams = [(words, nb), (words, nb - 1), (words, nb + 1), (flipped, nb)]
    for bit in rng.integers(0, 32 * used, 12):
        streams.append((words.at[bit // 32].set(words[bit // 32] ^ jnp.uint32(1 << (bit % 32))), nb))
    for w, b in streams:
        for x, y in zip(walk(w, b), jump(w, b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # 25 s from an empty compilation cache (six compiled coders): make test-all
def test_normalise_clip_zero_update_and_noise_levels():
    lattice = L.integer_lattice(1)
    d = 4000
    x = jnp.asarray(np.random.default_rng(5).normal(0, 1.0, d), jnp.float32)
    center = jnp.full((d,), 0.25, jnp.float32)
    norm = float(jnp.linalg.norm(x))
    keys = _keys(6)
    coders = {
        mode: clip_update(lrsuq_coder(lattice, Q.GaussianNoise(0.1)), gamma=2.0, mode=mode)
        for mode in ("normalise", "clip")
    }
    compiled = {mode: (jax.jit(c.encode), jax.jit(c.decode)) for mode, c in coders.items()}
    for mode, want_std, want_mean in (
        ("normalise", 0.1 * norm / 2.0, x),  # x + (||x||/γ) Z
        ("clip", 0.1, x * (2.0 / norm)),  # x·min(1, γ/||x||) + Z
    ):
        enc, dec = compiled[mode]
        message, info = enc(keys, PointMass(center + x), PointMass(center), ())
        y, decoded = dec(keys.shared, PointMass(center), (), message)
        assert int(decoded.errors) == 0 and bool(info.valid)
        err = np.asarray(y - center, np.float64) - np.asarray(want_mean, np.float64)
        assert stats.kstest(err / want_std, "norm").pvalue > P_MIN, mode
        assert float(message.num_bits) > (32 if mode == "normalise" else 0)
    # a zero update decodes to the center exactly (normalise sends ||X|| = 0)
    enc, dec = compiled["normalise"]
    message, _ = enc(keys, PointMass(center), PointMass(center), ())
    y, _ = dec(keys.shared, PointMass(center), (), message)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(center))
    # a client's own level through NoisePrior equals a coder built with that level (4 ulp: two programs)
    enc, dec = compiled["clip"]
    own = clip_update(lrsuq_coder(lattice, Q.GaussianNoise(0.3)), gamma=2.0, mode="clip")
    level = NoisePrior(center, jnp.float32(0.3))
    m1, _ = enc(keys, PointMass(center + x), level, ())
    y1, _ = dec(keys.shared, level, (), m1)
    m2, _ = jax.jit(own.encode)(keys, PointMass(center + x), PointMass(center), ())
    y2, _ = jax.jit(own.decode)(keys.shared, PointMass(center), (), m2)
    np.testing.assert_array_max_ulp(np.asarray(y1), np.asarray(y2), maxulp=4)
    assert float(m1.num_bits) == float(m2.num_bits)


def test_baselines_additive_noise_and_sdq():
    d = 6000
    x = jnp.asarray(np.random.default_rng(7).normal(0, 0.1, d), jnp.float32)
    zero = PointMass(jnp.zeros(d))
    keys = _keys(8)
    step = 0.05
    sdq = sdq_coder(L.integer_lattice(1, step))
    coders = {
        "gauss": additive_noise_coder(Q.GaussianNoise(0.2)),
        "laplace": additive_noise_coder(Q.LaplaceNoise(0.2), float32_coder()),
        "sdq": sdq,
        "noisy-sdq": additive_noise_coder(Q.GaussianNoise(0.2), sdq),
    }

    @jax.jit
    def round_trips(keys, other, x):
        """Every baseline's encode and decode in one program; the Gaussian encoder also under ``other``."""
        out = {}
        for name, coder in coders.items():
            message, info = coder.encode(keys, PointMass(x), zero, coder.init(d))
            y, decoded = coder.decode(keys.shared, zero, coder.init(d), message)
            out[name] = (message, info.valid, y, decoded.errors)
        return out, coders["gauss"].encode(other, PointMass(x), zero, ())[0].payload

    # the noise is the client's private randomness: another private key, another message
    out, other_payload = round_trips(keys, keys._replace(private=_keys(9).private), x)
    message, _, y, errors = out["gauss"]
    assert float(message.num_bits) == 32 * d  # float32 payload
    assert int(errors) == 0
    assert stats.kstest(np.asarray(y - x, np.float64) / 0.2, "norm").pvalue > P_MIN
    assert not np.array_equal(np.asarray(other_payload), np.asarray(message.payload))
    y = out["laplace"][2]
    assert stats.kstest(np.asarray(y - x, np.float64), "laplace", args=(0.0, 0.2)).pvalue > P_MIN
    _, valid, y, errors = out["sdq"]
    assert int(errors) == 0 and bool(valid)
    err = np.asarray(y - x, np.float64)
    assert stats.kstest(err, "uniform", args=(-step / 2, step)).pvalue > P_MIN
    _, _, y, errors = out["noisy-sdq"]
    assert int(errors) == 0
    assert abs(np.var(np.asarray(y - x)) - (0.04 + step**2 / 12)) < 5 * 0.04 * math.sqrt(2 / d)


def test_padding_nan_overflow_and_bad_arguments():
    """Padding, NaN and overflow on the law tests' programs (one dimension D, the properties do not depend
    on it): D is not a multiple of 3, so Z^3's last block is padded."""
    keys = _keys(11)
    assert D % 3 and num_blocks(D, L.integer_lattice(3)) == 4001 and num_blocks(D, L.e8()) == 1501
    assert num_blocks(203, L.integer_lattice(3)) == 68 and num_blocks(203, L.e8()) == 26
    run = _pipeline(L.integer_lattice(3), Q.GaussianNoise(SIGMA))
    x = jnp.asarray(np.random.default_rng(12).normal(0, 0.1, D), jnp.float32)
    y, errors, valid, _, _, overflow = run(keys, x)
    assert y.shape == (D,) and int(errors) == 0 and bool(valid) and not bool(overflow)
    # NaN input: flagged invalid at the encoder (never silently sent as a valid message)
    assert not bool(run(keys, x.at[7].set(jnp.nan))[2])
    # a stream that cannot fit its buffer is reported, not truncated: x = 3e7 needs ~51 bits per coordinate
    # against the buffer's CAP = 48
    _, _, valid, _, _, overflow = _pipeline(L.integer_lattice(1), Q.GaussianNoise(SIGMA))(
        keys, jnp.full((D,), 3e7, jnp.float32)
    )
    assert bool(overflow) and not bool(valid)
    with pytest.raises(ValueError, match="sigma"):
        Q.GaussianNoise(0.0)
    with pytest.raises(ValueError, match="b must"):
        Q.LaplaceNoise(-1.0)
    with pytest.raises(ValueError, match="one-dimensional"):
        lrsuq_coder(L.integer_lattice(2), Q.LaplaceNoise(0.1))
    with pytest.raises(ValueError, match="gamma"):
        clip_update(float32_coder(), gamma=0.0)
    with pytest.raises(ValueError, match="mode"):
        clip_update(float32_coder(), mode="rescale")
    with pytest.raises(ValueError, match="capacity_bits_per_coordinate"):
        lrsuq_coder(L.integer_lattice(1), Q.GaussianNoise(0.1), capacity_bits_per_coordinate=2)
    with pytest.raises(ValueError, match="p must be a PointMass"):
        lrsuq_coder(L.integer_lattice(1), Q.GaussianNoise(0.1)).encode(
            keys, PointMass(jnp.ones(3)), jnp.ones(3), ()
        )
    with pytest.raises(ValueError, match="noise must be"):
        additive_noise_coder(0.1)
    with pytest.raises(ValueError, match="MAX_STREAM_BITS|supported"):
        lattice_stream_capacity_words(20_000_000, 1, 0, 16)
