"""Lattices (sidejax/lattices.py): nearest() returns a lattice point and the nearest one (numpy float64 brute
force), the error lies in the Voronoi cell and reaches the covering radius, volumes and normalized second
moments match Conway & Sloane, jit/vmap equal eager, scaling is consistent, and bad arguments raise."""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax import lattices as L

LATTICES = [L.integer_lattice(1), L.integer_lattice(3), L.hexagonal(), L.d4(), L.e8()]
IDS = [lat.name for lat in LATTICES]

# normalized second moments G(Λ) = E||e||² / (n μ(𝒱)^{2/n}) (SPLAG Table 2.3); E8's is 929/12960
NSM = {"Z": 1.0 / 12.0, "A2": 5.0 / (36.0 * math.sqrt(3.0)), "D4": 0.0766032, "E8": 929.0 / 12960.0}
# (volume, covering radius, packing radius) at scale 1
GEOMETRY = {
    "Z^1": (1.0, 0.5, 0.5),
    "Z^3": (1.0, math.sqrt(3.0) / 2.0, 0.5),
    "A2": (math.sqrt(3.0) / 2.0, 1.0 / math.sqrt(3.0), 0.5),
    "D4": (2.0, 1.0, 1.0 / math.sqrt(2.0)),
    "E8": (1.0, 1.0, 1.0 / math.sqrt(2.0)),
}
EPS32 = float(np.finfo(np.float32).eps)


def _is_member(lat, p):
    """Membership by the lattice's defining rule, independent of its generator (float64 p [..., n])."""
    if lat.kind == "Z":
        return np.all(p == np.round(p), axis=-1)
    if lat.kind == "D4":
        return np.all(p == np.round(p), axis=-1) & (np.round(p.sum(-1)) % 2 == 0)
    if lat.kind == "E8":
        t = 2.0 * p  # all integer or all half-integer coordinates, and an even coordinate sum
        same = np.all(t == np.round(t), axis=-1) & np.all(
            np.round(t) % 2 == np.round(t[..., :1]) % 2, axis=-1
        )
        return same & (np.round(p.sum(-1)) % 2 == 0)
    # A2 = {(a, √3 b)} ∪ {(a + 1/2, √3 (b + 1/2))}
    u, v = p[..., 0], p[..., 1] / math.sqrt(3.0)
    return np.isclose(u, np.round(u), atol=1e-9) & np.isclose(v, np.round(v), atol=1e-9) | np.isclose(
        u - 0.5, np.round(u - 0.5), atol=1e-9
    ) & np.isclose(v - 0.5, np.round(v - 0.5), atol=1e-9)


def _brute_min_dist(lat, x):
    """min over lattice points near x of ||x − λ|| (float64). Candidates: Z^n / D4: floor(x) + {−1..2}^n
    filtered by the membership rule; E8: floor(x) + {0,1}^8 and floor(x − ½) + ½ + {0,1}^8 filtered (every
    coordinate of the nearest point is within the covering radius 1 of x's); A2: coordinates within ±2 of the
    rounded real solution G⁻¹x (the basis is reduced, the covering radius 1/√3)."""
    if lat.kind == "A2":
        g = lat.generator
        c0 = np.round(x @ np.linalg.inv(g).T)
        offs = np.array(list(itertools.product(range(-2, 3), repeat=2)), dtype=np.float64)
        cands = (c0[:, None, :] + offs[None]) @ g.T
    elif lat.kind == "E8":
        # the 2 x 256 candidates c = base + o in closed form: with r = x − base in [0, 1),
        # ||c − x||² = Σ r² + o·(1 − 2r), and Σ c is even iff Σ floor + Σ o is (Σ ½ over 8 coordinates = 4)
        offs = np.array(list(itertools.product((0, 1), repeat=8)), dtype=np.float64)
        best = np.full(x.shape[0], np.inf)
        for shift in (0.0, 0.5):
            floor = np.floor(x - shift)
            r = x - shift - floor
            d2 = np.sum(r**2, axis=-1)[:, None] + (1.0 - 2.0 * r) @ offs.T
            even = (floor.sum(-1)[:, None] + offs.sum(-1)[None]) % 2 == 0
            best = np.minimum(best, np.where(even, d2, np.inf).min(axis=1))
        return np.sqrt(np.maximum(best, 0.0))
    else:
        offs = np.array(list(itertools.product(range(-1, 3), repeat=lat.dim)), dtype=np.float64)
        cands = np.floor(x)[:, None, :] + offs[None]
    d = np.sqrt(np.sum((cands - x[:, None, :]) ** 2, axis=-1))
    d = np.where(_is_member(lat, cands), d, np.inf)
    return d.min(axis=1)


def _test_points(lat, seed):
    """Random normals, wide uniforms, large |x| (up to 1e3), exact lattice points and points near them."""
    rng = np.random.default_rng(seed)
    n = lat.dim
    coords = rng.integers(-50, 51, size=(500, n))
    on = coords @ lat.generator.T
    xs = [
        rng.normal(size=(1500, n)) * 3.0,
        rng.uniform(-20.0, 20.0, size=(1000, n)),
        rng.uniform(-1e3, 1e3, size=(500, n)),
        on,
        on + rng.normal(size=on.shape) * 0.3,
    ]
    return np.concatenate(xs).astype(np.float32)


@pytest.mark.parametrize("lat", LATTICES, ids=IDS)
def test_nearest_is_the_nearest_lattice_point(lat):
    x = _test_points(lat, seed=lat.dim)
    point, coords = lat.nearest(jnp.asarray(x))
    point, coords = np.asarray(point, np.float64), np.asarray(coords)
    assert coords.dtype == np.int32 and coords.shape == x.shape and point.shape == x.shape
    # point == G coords (exact for Z^n, D4, E8: integer / half-integer entries; A2 to float32 rounding)
    g_coords = coords.astype(np.float64) @ lat.generator.T
    if lat.kind == "A2":
        np.testing.assert_allclose(point, g_coords, rtol=0, atol=4 * EPS32 * (1 + np.abs(g_coords).max()))
    else:
        np.testing.assert_array_equal(point, g_coords)
    assert np.all(_is_member(lat, g_coords))
    # nearest: the decoder's distance equals the brute-force minimum up to float32 resolution of x
    x64 = x.astype(np.float64)
    d_dec = np.linalg.norm(x64 - g_coords, axis=-1)
    d_min = _brute_min_dist(lat, x64)
    tol = 8 * EPS32 * (1.0 + np.abs(x64).max(axis=-1))
    assert np.all(d_dec <= d_min + tol), np.max(d_dec - d_min - tol)
    # exact lattice points quantize to themselves
    rng = np.random.default_rng(lat.dim)
    c = rng.integers(-50, 51, size=(500, lat.dim))
    assert np.array_equal(coords[3000:3500], c)


@functools.cache
def _uniform() -> np.ndarray:
    """2^18 points of U[0,1)^8, drawn once (one compiled draw for every lattice): a lattice of dimension n
    takes the first n columns."""
    return np.asarray(jax.random.uniform(jax.random.key(7), (1 << 18, 8)))


@pytest.mark.parametrize("lat", LATTICES, ids=IDS)
def test_geometry_and_second_moment(lat):
    vol, cov, pack = GEOMETRY[lat.name]
    assert lat.volume == pytest.approx(vol, rel=1e-12)
    assert lat.volume == pytest.approx(abs(np.linalg.det(lat.generator)), rel=1e-12)
    assert lat.covering_radius == pytest.approx(cov, rel=1e-12)
    assert lat.packing_radius == pytest.approx(pack, rel=1e-12)
    # packing radius = half the shortest nonzero vector (all short vectors lie in the coordinate box ±2)
    box = np.array(list(itertools.product(range(-2, 3), repeat=min(lat.dim, 4))), dtype=np.float64)
    if lat.dim <= 4:
        norms = np.linalg.norm(box @ lat.generator.T, axis=-1)
        assert norms[norms > 0].min() / 2 == pytest.approx(pack, rel=1e-12)

    # x = G u, u ~ U[0,1)^n is uniform on a fundamental domain, so e = x − Q(x) is uniform on the cell
    num = _uniform().shape[0]
    x = _uniform()[:, : lat.dim] @ lat.generator.T.astype(np.float32)
    point, _ = lat.nearest(x)
    e = np.asarray(x, np.float64) - np.asarray(point, np.float64)
    norm = np.linalg.norm(e, axis=-1)
    assert norm.max() <= lat.covering_radius + 1e-6  # e lies in the Voronoi cell
    assert norm.max() >= 0.9 * lat.covering_radius  # ... and reaches out towards its deep holes
    s = norm**2 / (lat.dim * lat.volume ** (2.0 / lat.dim))
    mean, se = s.mean(), s.std() / math.sqrt(num)
    # 4 SE < 6.4e-4, a fifth of the smallest gap between Z (0.0833), A2 (0.0802), D4 (0.0766), E8 (0.0717)
    assert se < 1.6e-4
    assert abs(mean - NSM[lat.kind]) <= 4 * se, (mean, NSM[lat.kind], se)


@pytest.mark.parametrize(
    "lat, hole",
    [
        (L.integer_lattice(3), [0.5, 0.5, 0.5]),
        (L.hexagonal(), [0.5, 0.5 / math.sqrt(3.0)]),
        (L.d4(), [1.0, 0.0, 0.0, 0.0]),
        (L.e8(), [1.0] + [0.0] * 7),
    ],
    ids=["Z^3", "A2", "D4", "E8"],
)
def test_deep_hole_is_at_the_covering_radius(lat, hole):
    point, _ = lat.nearest(jnp.asarray(hole, jnp.float32))
    dist = np.linalg.norm(np.asarray(hole) - np.asarray(point, np.float64))
    assert dist == pytest.approx(lat.covering_radius, abs=1e-6)


@pytest.mark.parametrize("lat", LATTICES, ids=IDS)
def test_jit_and_vmap_match_eager(lat):
    x = jnp.asarray(_test_points(lat, seed=3)[:1200].reshape(4, 300, lat.dim))
    point, coords = lat.nearest(x)
    for p2, c2 in (
        jax.jit(lat.nearest)(x),
        jax.vmap(lat.nearest)(x),
        jax.jit(lambda lt, y: lt.nearest(y), static_argnums=0)(lat, x),
    ):
        np.testing.assert_array_equal(np.asarray(c2), np.asarray(coords))
        np.testing.assert_array_equal(np.asarray(p2), np.asarray(point))
    # a single point (no batch axes)
    p1, c1 = lat.nearest(x[1, 7])
    np.testing.assert_array_equal(np.asarray(c1), np.asarray(coords[1, 7]))


@functools.cache
def _normal() -> np.ndarray:
    """2,000 points of N(0, 1)^8, drawn once: a lattice of dimension n takes the first n columns."""
    return np.asarray(jax.random.normal(jax.random.key(11), (2000, 8)))


@pytest.mark.parametrize("make", [L.hexagonal, L.d4, L.e8, lambda scale: L.integer_lattice(2, scale)])
@pytest.mark.parametrize("scale", [0.25, 0.37])
def test_scaling_is_consistent(make, scale):
    base, lat = make(1.0), make(scale)
    n = base.dim
    assert lat.dim == n and lat.scale == scale and lat.kind == base.kind
    np.testing.assert_allclose(lat.generator, scale * base.generator, rtol=1e-15)
    assert lat.volume == pytest.approx(scale**n * base.volume, rel=1e-12)
    assert lat.covering_radius == pytest.approx(scale * base.covering_radius, rel=1e-12)
    assert lat.packing_radius == pytest.approx(scale * base.packing_radius, rel=1e-12)
    # host arithmetic (numpy float32, IEEE like XLA's) around the decoders: no eager kernels to compile
    x = (_normal()[:, :n] * 2.0).astype(np.float32)
    xs = x / np.float32(scale)
    point, coords = map(np.asarray, lat.nearest(x))
    p1, c1 = map(np.asarray, base.nearest(xs))
    if scale == 0.25:  # power of two: x / s is exact, so the decoders see identical inputs
        np.testing.assert_array_equal(coords, c1)
        np.testing.assert_array_equal(point, p1 * np.float32(scale))
    else:  # the scaled point is a nearest point of sΛ (distances agree with s·(unscaled) ones)
        d = np.linalg.norm((x - point).astype(np.float64), axis=-1)
        d1 = np.linalg.norm((xs - p1).astype(np.float64), axis=-1) * scale
        np.testing.assert_allclose(d, d1, atol=1e-5)
    np.testing.assert_allclose(
        point.astype(np.float64), coords.astype(np.float64) @ lat.generator.T, atol=1e-5
    )
    assert np.linalg.norm(x - point, axis=-1).max() <= lat.covering_radius + 1e-6


def test_validation():
    with pytest.raises(ValueError, match="x: trailing dimension"):
        L.e8().nearest(jnp.zeros((3, 4)))
    with pytest.raises(ValueError, match="x: trailing dimension"):
        L.hexagonal().nearest(jnp.zeros(()))
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1"):
        for make in (L.hexagonal, L.d4, L.e8, lambda scale: L.integer_lattice(3, scale)):
            with pytest.raises(ValueError, match="scale"):
                make(bad)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="n must be"):
            L.integer_lattice(bad)
    with pytest.raises(ValueError, match="dim must be 8"):
        L.Lattice("E8", 4)
    with pytest.raises(ValueError, match="kind"):
        L.Lattice("Leech", 24)
    # hashable and equal by value: usable as a static jit argument
    assert L.e8(0.5) == L.e8(0.5) and hash(L.e8(0.5)) == hash(L.e8(0.5)) and L.e8(0.5) != L.e8()
    # integer input is promoted to float
    point, coords = L.d4().nearest(jnp.asarray([[1, 1, 0, 0], [1, 0, 0, 0]]))
    assert jnp.issubdtype(point.dtype, jnp.floating)
    np.testing.assert_array_equal(np.asarray(point)[0], [1, 1, 0, 0])
