"""SDQ and LRSUQ (sidejax/coding/lrsuq.py): the decoder reproduces the encoder's reconstruction bit for bit,
the SDQ error is uniform on the Voronoi cell, the LRSUQ error has exactly the target law (KS against the exact
CDF, mean and variance) for small, huge and on-lattice inputs and is uncorrelated with the input, the number
of trials has mean 1/p (p = packing density), and bad arguments raise.

Each (lattice, noise) pair is one jit-compiled program vmapped over the N blocks of one message: every block
has its own latent and dithers from the counter hash of the message's key (independent samples)."""

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

N = 20_000  # samples per input group (>= 2e4 for each KS test)
P_MIN = 1e-3  # KS p-value floor (fixed keys: the outcome is deterministic)
K_SE = 5.0  # moments within this many standard errors


def _blocks(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def _inputs(lattice: L.Lattice, huge: float, seed: int) -> dict[str, np.ndarray]:
    """Three groups of N blocks: small random x, huge x (|x| >> beta), x exactly on lattice points."""
    rng = np.random.default_rng(seed)
    n = lattice.dim
    small = rng.normal(0.0, 0.5, size=(N, n))
    big = huge * np.sign(rng.normal(size=(N, n))) + rng.normal(0.0, 3.0, size=(N, n))
    j = rng.integers(-5, 6, size=(N, n))
    on = (lattice.generator @ j.T).T
    return {"small": small, "huge": big, "lattice": on}


@functools.partial(jax.jit, static_argnums=(2, 3))
def _lrsuq_batch(key, x, lattice, noise):
    """Block ``j`` of ``x [m, n]`` through the per-block encoder and decoder with the message key ``key``."""

    def one(j, xb):
        h, coords, x_enc = Q._lrsuq_encode(key, j, xb, lattice, noise)
        x_dec = Q.lrsuq_decode(key, j, h, coords, lattice, noise, xb.dtype)
        return h, coords, x_enc, x_dec

    return jax.vmap(one)(_blocks(x.shape[0]), x)


@functools.partial(jax.jit, static_argnums=(2,))
def _sdq_batch(key, x, lattice):
    def one(j, xb):
        coords = Q.sdq_encode(key, j, xb, lattice)
        return coords, Q.sdq_decode(key, j, coords, lattice, xb.dtype)

    return jax.vmap(one)(_blocks(x.shape[0]), x)


GAUSS_CASES = [
    (L.integer_lattice(1), 1.0),
    (L.integer_lattice(2), 0.7),
    (L.integer_lattice(3, scale=0.5), 1.3),  # a scaled lattice: same law, same acceptance
    (L.hexagonal(), 2.0),
]
EXPECTED_EH = {"Z^1": 1.0, "Z^2": 4.0 / math.pi, "Z^3*0.5": 6.0 / math.pi, "A2": 1.0 / 0.906900}


def _check_moments(err: np.ndarray, var: float, fourth: float) -> None:
    """Mean and variance of each coordinate within K_SE standard errors (fourth = E[Z^4])."""
    m = err.shape[0]
    se_mean = math.sqrt(var / m)
    se_var = math.sqrt((fourth - var**2) / m)
    np.testing.assert_array_less(np.abs(err.mean(0)), K_SE * se_mean)
    np.testing.assert_array_less(np.abs(err.var(0) - var), K_SE * se_var)


@functools.cache
def _lrsuq_run(lattice, noise, huge, seed):
    """The 3N blocks of ``_inputs(lattice, huge, seed)`` through ``_lrsuq_batch`` under the message key
    ``jax.random.key(seed)``, computed once per case and shared by the law test and the tests that reuse its
    program (acceptance ball, separate programs): ``(groups, x, key, h, coords, x_enc, x_dec)``."""
    groups = _inputs(lattice, huge, seed)
    x = np.concatenate(list(groups.values())).astype(np.float32)
    key = jax.random.key(seed)
    out = _lrsuq_batch(key, jnp.asarray(x), lattice, noise)
    return (groups, x, key, *map(np.asarray, out))


def _run_lrsuq(lattice, noise, huge, seed):
    groups, x, _, h, coords, x_enc, x_dec = _lrsuq_run(lattice, noise, huge, seed)
    np.testing.assert_array_equal(x_dec, x_enc)  # bit for bit, no NaN
    assert coords.dtype == np.int32 and np.all(h >= 1)
    err = x_dec.astype(np.float64) - x.astype(np.float64)
    return groups, x, h, err


@pytest.mark.parametrize("lattice,sigma", GAUSS_CASES, ids=[lat.name for lat, _ in GAUSS_CASES])
def test_lrsuq_gaussian_error_law_and_trials(lattice, sigma):
    noise = Q.GaussianNoise(sigma)
    groups, x, h, err = _run_lrsuq(lattice, noise, huge=1e4 * sigma, seed=7)
    n = lattice.dim
    for g, name in enumerate(groups):
        e = err[g * N : (g + 1) * N]
        for c in range(n):
            res = stats.kstest(e[:, c], stats.norm(scale=sigma).cdf)
            assert res.pvalue > P_MIN, (name, c, res)
        _check_moments(e, sigma**2, 3.0 * sigma**4)
    # the error is uncorrelated with the input (small-input group: x random with spread comparable to sigma)
    xs, es = x[:N].astype(np.float64), err[:N]
    for c in range(n):
        assert abs(np.corrcoef(xs[:, c], es[:, c])[0, 1]) < K_SE / math.sqrt(N)
    # coordinates of one block are uncorrelated with each other (isotropic Gaussian)
    if n > 1:
        assert abs(np.corrcoef(err[:, 0], err[:, 1])[0, 1]) < K_SE / math.sqrt(err.shape[0])
    # trials: h ~ Geom(p), p = packing density, independent of x
    p = Q.acceptance_probability(lattice, noise)
    assert p == pytest.approx(1.0 / EXPECTED_EH[lattice.name], rel=1e-5)
    if n == 1:
        assert np.all(h == 1)
    else:
        se = math.sqrt((1.0 - p) / p**2 / h.size)
        assert abs(h.mean() - 1.0 / p) < K_SE * se
        for g in range(3):
            assert abs(h[g * N : (g + 1) * N].mean() - 1.0 / p) < K_SE * se * math.sqrt(3.0)


def test_lrsuq_laplace_error_law():
    b = 0.7
    lattice = L.integer_lattice(1)
    noise = Q.LaplaceNoise(b)
    groups, x, h, err = _run_lrsuq(lattice, noise, huge=1e4 * b, seed=11)
    assert np.all(h == 1) and Q.acceptance_probability(lattice, noise) == 1.0
    for g, name in enumerate(groups):
        e = err[g * N : (g + 1) * N]
        res = stats.kstest(e[:, 0], stats.laplace(scale=b).cdf)
        assert res.pvalue > P_MIN, (name, res)
        _check_moments(e, 2.0 * b**2, 24.0 * b**4)
    assert abs(np.corrcoef(x[:N, 0], err[:N, 0])[0, 1]) < K_SE / math.sqrt(N)


def test_lrsuq_encoder_accepts_in_the_ball():
    """The reconstruction is beta (M_h + V_h) with ||M_h + V_h - x/beta|| <= rho, M_h a lattice point. On the
    A2 law test's program and its N small inputs (the property does not depend on sigma)."""
    lattice, sigma = GAUSS_CASES[3]
    noise = Q.GaussianNoise(sigma)
    _, x, key, h, _, _, x_dec = _lrsuq_run(lattice, noise, 1e4 * sigma, 7)
    x, x_dec, h = x[:N], x_dec[:N], h[:N]
    _, beta = jax.vmap(lambda j: Q.lrsuq_latent(key, j, lattice, noise))(_blocks(N))
    beta = np.asarray(beta, np.float64)[:, None]
    scaled = (np.asarray(x_dec, np.float64) - np.asarray(x, np.float64)) / beta
    assert np.all(np.linalg.norm(scaled, axis=1) <= lattice.packing_radius * (1 + 1e-5))
    # the rejected trials (i < h) really fail the test: re-run trial h - 1 by hand for the blocks with h > 1
    rej = np.flatnonzero(h > 1)
    assert rej.size > 50
    for b in rej[:20]:
        v = Q.sample_dither(key, int(b), int(h[b]) - 1, lattice)
        y = np.asarray(x[b]) / beta[b, 0] - np.asarray(v)
        pt, _ = lattice.nearest(jnp.asarray(y, jnp.float32))
        assert np.linalg.norm(np.asarray(pt) - y) > lattice.packing_radius


def test_lrsuq_separate_decoder_program_matches():
    """A decoder compiled on its own (the server's program) gives the encoder's reconstruction bit for bit;
    so does an encoder compiled on its own. On the Z^2 law test's 3N blocks."""
    lattice, sigma = GAUSS_CASES[1]
    noise = Q.GaussianNoise(sigma)
    _, x, key, h, coords, x_enc, _ = _lrsuq_run(lattice, noise, 1e4 * sigma, 7)
    m = x.shape[0]
    enc = jax.jit(jax.vmap(lambda j, c: Q.lrsuq_encode(key, j, c, lattice, noise)))(_blocks(m), x)
    np.testing.assert_array_equal(np.asarray(enc[0]), h)
    np.testing.assert_array_equal(np.asarray(enc[1]), coords)
    dec = jax.jit(jax.vmap(lambda j, c, d: Q.lrsuq_decode(key, j, c, d, lattice, noise)))
    np.testing.assert_array_equal(np.asarray(dec(_blocks(m), h, coords)), x_enc)


def test_sdq_error_uniform_on_the_cell():
    # Z^2: each coordinate uniform on [-1/2, 1/2)
    lattice = L.integer_lattice(2)
    x = np.concatenate(list(_inputs(lattice, 1e3, 2).values())).astype(np.float32)
    coords, x_hat = _sdq_batch(jax.random.key(21), jnp.asarray(x), lattice)
    err = np.asarray(x_hat, np.float64) - x.astype(np.float64)
    for g in range(3):
        for c in range(2):
            res = stats.kstest(err[g * N : (g + 1) * N, c], stats.uniform(loc=-0.5, scale=1.0).cdf)
            assert res.pvalue > P_MIN, (g, c, res)
    assert abs(np.corrcoef(x[:N, 0], err[:N, 0])[0, 1]) < K_SE / math.sqrt(N)
    # the encoder sends the coordinates of M = Q(x - V), V the block's trial-1 dither
    v = jax.vmap(lambda j: Q.sample_dither(jax.random.key(21), j, 1, lattice, jnp.float32))(
        _blocks(x.shape[0])
    )
    _, want = lattice.nearest(jnp.asarray(x) - v)
    np.testing.assert_array_equal(np.asarray(coords), np.asarray(want))
    # A2: the error lies in the Voronoi cell and has the cell's second moment E||e||^2 = 5/36
    lattice = L.hexagonal()
    x = np.random.default_rng(3).normal(0.0, 5.0, size=(N, 2)).astype(np.float32)
    _, x_hat = _sdq_batch(jax.random.key(22), jnp.asarray(x), lattice)
    err = np.asarray(x_hat, np.float64) - x.astype(np.float64)
    _, c0 = lattice.nearest(jnp.asarray(err * (1 - 1e-4), jnp.float32))
    assert np.all(np.asarray(c0) == 0)
    sq = np.sum(err**2, axis=1)
    assert abs(sq.mean() - 5.0 / 36.0) < K_SE * sq.std() / math.sqrt(N)
    assert np.all(np.abs(err.mean(0)) < K_SE * err.std(0) / math.sqrt(N))


def test_sample_dither_uniform_on_the_cell():
    """A2 dithers lie in the Voronoi cell and have the law of a uniform point of the cell (two-sample KS of
    each coordinate against a numpy rejection sampler of the hexagon)."""
    lattice = L.hexagonal()
    v = np.asarray(
        jax.vmap(lambda j: Q.sample_dither(jax.random.key(31), j, 1, lattice))(_blocks(N)), np.float64
    )
    _, c0 = lattice.nearest(jnp.asarray(v * (1 - 1e-4), jnp.float32))
    assert np.all(np.asarray(c0) == 0)
    # numpy oracle: rejection-sample the hexagonal cell from its bounding box and compare the first
    # coordinate's law (two-sample KS)
    rng = np.random.default_rng(4)
    box = rng.uniform([-0.5, -1 / math.sqrt(3)], [0.5, 1 / math.sqrt(3)], size=(4 * N, 2))
    pts = np.stack([np.zeros(2), *[np.array(p) for p in _hex_neighbours()]])
    d = np.linalg.norm(box[:, None, :] - pts[None], axis=-1)
    ref = box[np.argmin(d, axis=1) == 0]
    for c in range(2):
        assert stats.ks_2samp(v[:, c], ref[:, c]).pvalue > P_MIN


def _hex_neighbours():
    return [(math.cos(k * math.pi / 3), math.sin(k * math.pi / 3)) for k in range(6)]


def test_validation():
    z1, z2 = L.integer_lattice(1), L.integer_lattice(2)
    key = jax.random.key(0)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="sigma"):
            Q.GaussianNoise(bad)
        with pytest.raises(ValueError, match="b must"):
            Q.LaplaceNoise(bad)
    with pytest.raises(ValueError, match="noise: LaplaceNoise needs a one-dimensional lattice"):
        Q.lrsuq_encode(key, 0, jnp.zeros(2), z2, Q.LaplaceNoise(1.0))
    with pytest.raises(ValueError, match="noise: LaplaceNoise"):
        Q.acceptance_probability(z2, Q.LaplaceNoise(1.0))
    with pytest.raises(ValueError, match="noise must be"):
        Q.lrsuq_encode(key, 0, jnp.zeros(1), z1, 1.0)
    with pytest.raises(ValueError, match="lattice must be"):
        Q.sdq_encode(key, 0, jnp.zeros(2), "Z2")
    with pytest.raises(ValueError, match="x must have shape"):
        Q.lrsuq_encode(key, 0, jnp.zeros(3), z2, Q.GaussianNoise(1.0))
    with pytest.raises(ValueError, match="x must have shape"):
        Q.sdq_encode(key, 0, jnp.zeros((4, 2)), z2)
    with pytest.raises(ValueError, match="coords must be"):
        Q.sdq_decode(key, 0, jnp.zeros(2), z2)
    with pytest.raises(ValueError, match="h must be"):
        Q.lrsuq_decode(key, 0, jnp.float32(1.0), jnp.zeros(2, jnp.int32), z2, Q.GaussianNoise(1.0))


def test_non_finite_input_is_not_encoded():
    """No trial can accept a NaN input: the encoder returns h = 0 (instead of looping) and decodes to NaN."""
    lattice, noise = L.integer_lattice(2), Q.GaussianNoise(1.0)
    key = jax.random.key(0)
    h, coords = Q.lrsuq_encode(key, 0, jnp.array([jnp.nan, 0.0]), lattice, noise)
    assert int(h) == 0
    assert np.all(np.isnan(np.asarray(Q.lrsuq_decode(key, 0, h, coords, lattice, noise))))


@pytest.mark.slow  # two programs agree within 4 ULP with XLA's default emitters only (Makefile)
def test_a_one_dimensional_lattice_accepts_its_first_trial_whatever_float32_rounding_says():
    """Z^1's p = 1 holds in exact arithmetic; its stream sends no trial index, so the decoder rebuilds
    trial 1. Before the fix a float32 rounding of the residual could reject trial 1: with scale 0.1 the
    encoder kept a later trial for 15 of these 400,000 blocks (a silent wrong value), and with scale 1 and
    ``x/β = 2^23 + 1`` every trial was rejected until trial 8,981,265."""
    noise = Q.GaussianNoise(0.5)
    z = L.integer_lattice(1, 0.1)
    n = 400_000
    key = jax.random.key(1)
    x = jnp.asarray(np.random.default_rng(3).normal(0.0, 1000.0, (n, 1)), jnp.float32)
    h, coords, x_hat = jax.jit(jax.vmap(lambda j, v: Q._lrsuq_encode(key, j, v, z, noise)))(_blocks(n), x)
    assert np.all(np.asarray(h) == 1)
    decoded = jax.jit(jax.vmap(lambda j, hh, c: Q.lrsuq_decode(key, j, hh, c, z, noise)))(
        _blocks(n), h, coords
    )
    # two compiled programs: within 4 ULP (a later trial's dither would differ by up to a cell, 0.1 β)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(x_hat), rtol=2.0**-21, atol=0)
    # scale 1, x/β an odd integer just above 2^23: trial 1, a finite value, no endless loop
    one = L.integer_lattice(1, 1.0)
    _, beta = Q.lrsuq_latent(key, 0, one, noise, jnp.float32)
    x_big = jnp.asarray([float(beta) * (2.0**23 + 1.0)], jnp.float32)
    h1, c1, xh1 = Q._lrsuq_encode(key, 0, x_big, one, noise)
    assert int(h1) == 1 and np.all(np.isfinite(np.asarray(xh1)))
    np.testing.assert_array_equal(Q.lrsuq_decode(key, 0, h1, c1, one, noise), xh1)


LATENT_CASES = [
    (L.integer_lattice(1), Q.GaussianNoise(0.3)),  # χ²_3: one exponential pair and a Box-Muller normal
    (L.integer_lattice(2), Q.GaussianNoise(0.3)),  # χ²_4
    (L.d4(), Q.GaussianNoise(0.3)),  # χ²_6
    (L.e8(), Q.GaussianNoise(0.3)),  # χ²_10: the product of five uniforms under one logarithm
    (L.integer_lattice(1), Q.LaplaceNoise(0.3)),  # Gamma(2, 1)
]


@pytest.mark.parametrize(
    "lattice,noise", LATENT_CASES, ids=[f"{lat.name}-{type(nz).__name__}" for lat, nz in LATENT_CASES]
)
def test_latent_has_its_exact_law(lattice, noise):
    """The latent ``U`` read from the counter hash: ``(r/σ)² ~ χ²_{n+2}`` (Gaussian) and ``r/b ~ Gamma(2, 1)``
    (Laplace), KS against the exact CDF over 4N blocks; blocks and messages independent (the latents of
    neighbouring blocks, and of two message keys, uncorrelated)."""
    m = 4 * N
    latent = jax.jit(jax.vmap(lambda k, j: Q.lrsuq_latent(k, j, lattice, noise)[0], (None, 0)))
    r = np.asarray(latent(jax.random.key(41), _blocks(m)), np.float64)
    other = np.asarray(latent(jax.random.key(42), _blocks(m)), np.float64)
    if isinstance(noise, Q.GaussianNoise):
        u, law = (r / noise.sigma) ** 2, stats.chi2(lattice.dim + 2)
    else:
        u, law = r / noise.b, stats.gamma(2.0)
    assert stats.kstest(u, law.cdf).pvalue > P_MIN
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < K_SE / math.sqrt(m)
    assert abs(np.corrcoef(r, other)[0, 1]) < K_SE / math.sqrt(m)
