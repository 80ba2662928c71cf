r"""Subtractive dithered quantization (SDQ) and layered rejection-sampled universal quantization (LRSUQ).

The quantizers of CEPAM (docs/papers/cepam.md#s2-2). ``Λ`` is a :class:`~sidejax.lattices.Lattice` with
nearest-point map ``Q`` (:meth:`~sidejax.lattices.Lattice.nearest`), Voronoi cell ``𝒫``, volume ``μ(𝒫)`` and
packing radius ``ρ`` (the inradius of ``𝒫``).

**Dither.** ``V ~ Unif(𝒫)`` is drawn as ``V = u − Q(u)`` with ``u = G w``, ``w ~ Unif[0, 1)^n``: ``u`` is
uniform on the fundamental parallelepiped ``G[0, 1)^n`` and ``u ↦ u − Q(u)`` maps it onto ``𝒫``
piece by piece by lattice translations (both are fundamental domains of ``Λ``, so the map is a
measure-preserving bijection up to a null set); hence ``V`` is uniform on the Voronoi cell.

**SDQ** (Definition 1): the encoder sends the coordinates of ``M = Q(x − V)``, the decoder outputs
``x̂ = M + V``; by the crypto lemma ``x̂ − x ~ Unif(𝒫)``, independent of ``x``.

**LRSUQ** (Definition 4, Proposition 5): shared randomness ``S = (U, (V_i)_{i≥1})``, a latent ``U`` drawn from
``layer_key`` and iid dithers ``V_i`` drawn from ``draw_key(dither_key, i)``. Given ``U`` the superlevel set
of the noise pdf ``f`` is a ball of radius ``r(U)`` and ``β = r / ρ`` is the smallest scale with
``L_U^+(f) ⊆ β𝒫``. In scaled coordinates (docs/papers/cepam.md#s2-5 [REC]) trial ``i`` computes

.. math::

    y_i = x/β − V_i,\quad M_i = Q(y_i),\quad e_i = M_i − y_i ∈ 𝒫,

and the encoder stops at ``h = min{i : ||e_i||_2 ≤ r/β = ρ}`` (eq. (8)) and sends ``(h, coords(M_h))``; the
decoder regenerates ``U`` and ``V_h`` and outputs ``x̂ = β (M_h + V_h)`` (eq. (7)). Conditional on ``U`` the
error ``x̂ − x = β e_h`` is uniform on the ball ``L_U^+(f)``, and mixing over ``U`` gives ``x̂ − x ~ f``,
independent of ``x``. Each trial accepts independently with probability ``p = μ(ρB^n)/μ(𝒫)`` (the packing
density of ``Λ``, whatever ``x`` and ``U``), so ``h ~ Geom(p)`` and ``E[h] = 1/p``. The trial loop is a
``lax.while_loop`` without a cap. The two noises (docs/papers/cepam.md#s2-5, Lemmas 17/18):

* :class:`GaussianNoise` ``N(0, σ² I_n)``, any ``n``: ``U ~ χ²_{n+2}`` (a sum of ``n + 2`` squared standard
  normals), ``r = σ√U``, ``β = σ√U / ρ`` (``2σ√U`` on ``Z^n``). Acceptance ``p = V_n ρ^n / μ(𝒫)``: 1 on
  ``Z^1``, ``π/4`` on ``Z^2``, ``π/6`` on ``Z^3``, ``π/√12`` on ``A2``.
* :class:`LaplaceNoise` ``Lap(0, b)`` (density ``e^{−|z|/b}/(2b)``), ``n = 1`` only: ``U ~ Gamma(2, 1)``
  (``−log u₁ − log u₂``, ``u_k`` uniform), ``r = bU``, ``β = bU/ρ`` (``2bU`` on ``Z^1``); the interval
  ``[−r, r]`` is ``β𝒫`` itself, so ``p = 1``.

Numerics: the coordinates are int32, so ``|x|/β`` must stay below ``2^31`` lattice steps; in float32 the
error ``x̂ − x`` carries a rounding error of about ``eps·|x|``. An input for which no trial can be tested
(``x`` not finite, or ``x/β`` outside the int32 coordinate range, e.g. for a latent ``U`` that underflows)
is not encoded: the encoder returns ``h = 0`` (never a valid trial index) and the decoder maps ``h = 0`` to
NaN, instead of looping forever.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from sidejax import keys
from sidejax.distributions import uniform_open
from sidejax.lattices import Lattice
from sidejax.types import PRNGKey
from sidejax.utils import check_positive

__all__ = [
    "GaussianNoise",
    "LaplaceNoise",
    "sample_dither",
    "sdq_encode",
    "sdq_decode",
    "lrsuq_latent",
    "acceptance_probability",
    "lrsuq_encode",
    "lrsuq_decode",
]

# |y| / scale above this many lattice steps would overflow the int32 coordinates (with margin for the
# basis change of A2, D4, E8, whose coordinates are at most about 2|y|/scale)
_COORD_LIMIT = 2.0**29


@dataclasses.dataclass(frozen=True)
class GaussianNoise:
    """The error law ``N(0, σ² I_n)`` of an LRSUQ (any lattice dimension ``n``); hashable (a static argument).

    Attributes:
        sigma: the standard deviation ``σ > 0`` of every coordinate.
    """

    sigma: float

    def __post_init__(self):
        object.__setattr__(self, "sigma", check_positive(self.sigma, "sigma"))


@dataclasses.dataclass(frozen=True)
class LaplaceNoise:
    """The error law ``Lap(0, b)`` (density ``e^{−|z|/b} / (2b)``) of an LRSUQ on a one-dimensional lattice;
    hashable (a static argument).

    Attributes:
        b: the scale ``b > 0`` (variance ``2b²``).
    """

    b: float

    def __post_init__(self):
        object.__setattr__(self, "b", check_positive(self.b, "b"))


def _check_lattice(lattice) -> None:
    if not isinstance(lattice, Lattice):
        raise ValueError(f"lattice must be a sidejax.lattices.Lattice, got {type(lattice).__name__}")


def _check_noise(noise, lattice: Lattice) -> None:
    if not isinstance(noise, GaussianNoise | LaplaceNoise):
        raise ValueError(f"noise must be a GaussianNoise or a LaplaceNoise, got {type(noise).__name__}")
    if isinstance(noise, LaplaceNoise) and lattice.dim != 1:
        raise ValueError(f"noise: LaplaceNoise needs a one-dimensional lattice, got {lattice.name}")


def _check_x(x, lattice: Lattice) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != (lattice.dim,):
        raise ValueError(f"x must have shape ({lattice.dim},) (one block; vmap over blocks), got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def _check_coords(coords, lattice: Lattice) -> jax.Array:
    coords = jnp.asarray(coords)
    if coords.shape != (lattice.dim,) or not jnp.issubdtype(coords.dtype, jnp.integer):
        raise ValueError(
            f"coords must be an integer array of shape ({lattice.dim},), "
            f"got {coords.dtype}{list(coords.shape)}"
        )
    return coords


def _point(lattice: Lattice, coords: jax.Array, dtype) -> jax.Array:
    """``(sG) coords`` in ``dtype``: the one expression encoders and decoders use for a lattice point."""
    gen = jnp.asarray(lattice.generator, dtype)
    return jnp.einsum("ij,...j->...i", gen, coords.astype(dtype), precision=jax.lax.Precision.HIGHEST)


def sample_dither(key: PRNGKey, lattice: Lattice, dtype=None) -> jax.Array:
    """A dither ``V ~ Unif(𝒫)``, uniform on the Voronoi cell of ``lattice``.

    ``V = u − Q(u)`` with ``u = (sG) w``, ``w ~ Unif[0, 1)^n``: ``u`` is uniform on the fundamental
    parallelepiped ``sG[0, 1)^n``, and reducing it modulo ``Λ`` onto the Voronoi cell is a measure-preserving
    bijection between two fundamental domains (up to a null set), so ``V`` is uniform on the cell.

    Args:
        key: a PRNG key (used as is).
        lattice: the lattice.
        dtype: float dtype of ``V`` (default: the default float dtype).

    Returns:
        ``V [n]``.
    """
    _check_lattice(lattice)
    dtype = jnp.result_type(float) if dtype is None else dtype
    w = jax.random.uniform(key, (lattice.dim,), dtype)
    gen = jnp.asarray(lattice.generator, dtype)
    u = jnp.einsum("ij,j->i", gen, w, precision=jax.lax.Precision.HIGHEST)
    q, _ = lattice.nearest(u)
    return u - q


def sdq_encode(dither_key: PRNGKey, x: jax.Array, lattice: Lattice) -> jax.Array:
    """Subtractive dithered quantization, encoder: the coordinates of ``M = Q(x − V)``,
    ``V = sample_dither(dither_key, lattice)``.

    Args:
        dither_key: the key of the dither, shared with the decoder.
        x: one block ``[n]`` (vmap over blocks, with one dither key per block).
        lattice: the lattice ``Λ`` (``n = lattice.dim``).

    Returns:
        int32 ``coords [n]`` with ``M = generator @ coords``.

    Raises:
        ValueError: if ``lattice`` is not a Lattice or ``x`` is not of shape ``[n]``.
    """
    _check_lattice(lattice)
    x = _check_x(x, lattice)
    v = sample_dither(dither_key, lattice, x.dtype)
    _, coords = lattice.nearest(x - v)
    return coords


def sdq_decode(dither_key: PRNGKey, coords: jax.Array, lattice: Lattice, dtype=None) -> jax.Array:
    """Subtractive dithered quantization, decoder: ``x̂ = M + V`` with ``M = (sG) coords`` and the
    regenerated dither ``V``; ``x̂ − x ~ Unif(𝒫)``, independent of ``x`` (crypto lemma).

    Args:
        dither_key: the encoder's dither key.
        coords: ``sdq_encode``'s output, integer ``[n]``.
        lattice: the encoder's lattice.
        dtype: float dtype of ``x̂`` (default: the default float dtype; use the encoder input's dtype).

    Returns:
        ``x̂ [n]``.

    Raises:
        ValueError: if ``lattice`` is not a Lattice or ``coords`` is not an integer array of shape ``[n]``.
    """
    _check_lattice(lattice)
    coords = _check_coords(coords, lattice)
    dtype = jnp.result_type(float) if dtype is None else dtype
    return _point(lattice, coords, dtype) + sample_dither(dither_key, lattice, dtype)


def lrsuq_latent(
    layer_key: PRNGKey, lattice: Lattice, noise, dtype=None, level=None
) -> tuple[jax.Array, jax.Array]:
    """The shared latent of an LRSUQ block: the radius ``r`` of the superlevel set and the scale ``β = r/ρ``.

    Gaussian ``N(0, σ²I_n)``: ``U ~ χ²_{n+2}``, ``r = σ√U``. Laplace ``Lap(0, b)``: ``U ~ Gamma(2, 1)``,
    ``r = bU``. ``U`` is drawn from ``layer_key`` as is, by a fixed number of draws (no rejection loop, so
    vmapped over blocks every block costs the same):

    * ``χ²_{n+2}`` is by definition the law of ``Σ_{k=1}^{n+2} Z_k²`` with ``Z_k`` iid ``N(0, 1)``; ``U`` is
      that sum over ``n + 2`` standard normals (``jax.random.normal`` of shape ``(n + 2,)``).
    * ``Gamma(2, 1)`` is the law of ``E₁ + E₂`` with ``E_k`` iid ``Exp(1)`` (a sum of independent
      ``Gamma(a_k, 1)`` is ``Gamma(Σa_k, 1)``), and ``E = −log u`` with ``u ~ Unif(0, 1]`` is ``Exp(1)``
      (``P(−log u > t) = P(u < e^{−t}) = e^{−t}``); ``U = −log u₁ − log u₂`` with ``u_k`` from
      :func:`sidejax.distributions.uniform_open` (float32 uniforms ``(j + ½)·2^{−23}``, never 0, so the
      logarithm stays finite).

    Both laws are exact up to the resolution of the float32 samplers (as for any float32 draw): the
    uniforms lie on a grid of step ``2^{−23}`` (each ``E_k ≤ 24 log 2 ≈ 16.6``, the mass ``2^{−23}`` of the
    lowest cell sitting at its midpoint), and ``jax.random.normal`` is ``√2 erf⁻¹`` of a uniform on a grid of
    step ``2^{−22}`` in ``(−1, 1)`` (``|Z_k| ≲ 5.2``; the tail beyond has mass ``≈ 2^{−23}``). ``U`` is kept
    at least the smallest normal float (``U = 0`` has probability zero; it would make ``β = 0``).

    Args:
        layer_key: the key of the latent, shared with the decoder.
        lattice: the lattice (its packing radius ``ρ``).
        noise: :class:`GaussianNoise` or :class:`LaplaceNoise` (the latter with ``lattice.dim == 1``).
        dtype: float dtype (default: the default float dtype).
        level: optional (traced) noise level replacing ``noise.sigma`` / ``noise.b`` (a client's own level,
            CEPAM's privacy adaptability); ``None`` uses the noise's.

    Returns:
        ``(r, beta)``, scalars.

    Raises:
        ValueError: on a bad ``lattice`` or ``noise``.
    """
    _check_lattice(lattice)
    _check_noise(noise, lattice)
    dtype = jnp.result_type(float) if dtype is None else dtype
    tiny = jnp.finfo(dtype).tiny
    if isinstance(noise, GaussianNoise):
        u = jnp.sum(jnp.square(jax.random.normal(layer_key, (lattice.dim + 2,), dtype)))  # χ²_{n+2}
        scale = noise.sigma if level is None else jnp.asarray(level, dtype)
        r = scale * jnp.sqrt(jnp.maximum(u, tiny))
    else:
        u = -jnp.sum(jnp.log(uniform_open(layer_key, (2,)).astype(dtype)))  # Exp(1) + Exp(1) = Gamma(2, 1)
        scale = noise.b if level is None else jnp.asarray(level, dtype)
        r = scale * jnp.maximum(u, tiny)
    return r, r / lattice.packing_radius


def acceptance_probability(lattice: Lattice, noise) -> float:
    """Per-trial acceptance probability ``p`` of an LRSUQ (independent of ``x`` and ``U``); ``E[h] = 1/p``.

    Gaussian: ``p = V_n ρ^n / μ(𝒫)`` with ``V_n = π^{n/2} / Γ(n/2 + 1)``, the packing density of ``Λ``.
    Laplace on a one-dimensional lattice: ``p = 1``.

    Raises:
        ValueError: on a bad ``lattice`` or ``noise``.
    """
    _check_lattice(lattice)
    _check_noise(noise, lattice)
    if isinstance(noise, LaplaceNoise):
        return 1.0
    n = lattice.dim
    ball = math.pi ** (n / 2.0) / math.gamma(n / 2.0 + 1.0) * lattice.packing_radius**n
    p = ball / lattice.volume
    return 1.0 if abs(p - 1.0) < 1e-12 else p  # Z^1: the ball is the cell (exactly 1, not 1 ± ulp)


def lrsuq_encode(
    layer_key: PRNGKey, dither_key: PRNGKey, x: jax.Array, lattice: Lattice, noise
) -> tuple[jax.Array, jax.Array]:
    """LRSUQ encoder of one block: rejection-sample dithers until the scaled residual lies in the ball.

    With ``(r, β) = lrsuq_latent(layer_key, …)`` and ``V_i = sample_dither(draw_key(dither_key, i), …)``,
    trial ``i = 1, 2, …`` computes ``y_i = x/β − V_i``, ``M_i = Q(y_i)`` and accepts iff
    ``||M_i − y_i||_2 ≤ r/β = ρ`` (tested as ``Σ(M_i − y_i)² ≤ ρ²``). A ``lax.while_loop`` with no cap:
    ``h ~ Geom(p)`` (:func:`acceptance_probability`).

    Args:
        layer_key: key of the latent ``U`` (shared with the decoder).
        dither_key: key of the dither family (shared with the decoder).
        x: one block ``[n]`` (vmap over blocks with independent key pairs).
        lattice: the lattice.
        noise: :class:`GaussianNoise` or :class:`LaplaceNoise`.

    Returns:
        ``(h, coords)``: the int32 trial index ``h ≥ 1`` (``0`` if ``x`` could not be encoded: not finite,
        or ``x/β`` beyond the int32 coordinate range) and the int32 coordinates ``[n]`` of ``M_h``.

    Raises:
        ValueError: on a bad ``lattice``, ``noise`` or ``x`` shape.
    """
    h, coords, _ = _lrsuq_encode(layer_key, dither_key, x, lattice, noise)
    return h, coords


def _lrsuq_encode(layer_key, dither_key, x, lattice, noise, level=None):
    """:func:`lrsuq_encode` plus the encoder's own reconstruction ``β(M_h + V_h)`` (for tests); ``level``
    as in :func:`lrsuq_latent`. The per-block reference of the vector encoder
    :func:`sidejax.coding.lattice.lrsuq_quantize` (which must return the same ``(h, coords)`` bit for bit)."""
    _check_lattice(lattice)
    _check_noise(noise, lattice)
    x = _check_x(x, lattice)
    beta, xs, ok = _scaled_input(layer_key, x, lattice, noise, level)
    h, coords, v = _trial_loop(dither_key, xs, lattice, jnp.int32(0), ~ok)
    x_hat = _reconstruct(lattice, beta, coords, v, h)
    return h, coords, x_hat


def _scaled_input(layer_key, x, lattice, noise, level):
    """``(β, x/β, ok)`` of one block: the scale from :func:`lrsuq_latent`, the scaled input, and whether
    trials can be tested (``x/β`` finite and within the int32 coordinate range)."""
    _, beta = lrsuq_latent(layer_key, lattice, noise, x.dtype, level)
    xs = x / beta
    ok = jnp.all(jnp.isfinite(xs) & (jnp.abs(xs) < _COORD_LIMIT * lattice.scale))
    return beta, xs, ok


def _trial(dither_key, xs, i, lattice):
    """Trial ``i`` of one block with scaled input ``xs = x/β``: ``(coords of M_i, V_i, accepted)`` with
    ``V_i`` from ``draw_key(dither_key, i)``, ``M_i = Q(xs − V_i)`` and acceptance iff
    ``Σ(M_i − (xs − V_i))² ≤ ρ²``."""
    dtype = xs.dtype
    v = sample_dither(keys.draw_key(dither_key, i), lattice, dtype)
    y = xs - v
    _, coords = lattice.nearest(y)
    e = _point(lattice, coords, dtype) - y
    inside = jnp.sum(jnp.square(e)) <= lattice.packing_radius**2
    # On a one-dimensional lattice the ball of radius ρ = s/2 is the whole cell: every trial accepts in
    # exact arithmetic (p = 1), and the stream sends no trial index (the decoder takes h = 1). A float32
    # rounding of the residual must not reject it: with a scale that is not a power of two that kept trial
    # 2 while the decoder rebuilt trial 1, and for |x/β| an odd integer in [2^23, 2^24) every trial was
    # rejected and the encoder never stopped.
    return coords, v, inside | (lattice.dim == 1)


def _trial_loop(dither_key, xs, lattice, start, accepted):
    """Trials ``start + 1, start + 2, …`` of one block until one accepts (a ``lax.while_loop`` with no
    cap); none runs when ``accepted`` is already True. Returns ``(h, coords, V_h)``: the accepted trial's
    index, coordinates and dither, or ``(start, 0, 0)`` when no trial ran."""
    dtype = xs.dtype

    def cond(state):
        return ~state[3]

    def body(state):
        i = state[0] + 1
        coords, v, ok = _trial(dither_key, xs, i, lattice)
        return i, coords, v, ok

    init = (
        jnp.asarray(start, jnp.int32),
        jnp.zeros((lattice.dim,), jnp.int32),
        jnp.zeros((lattice.dim,), dtype),
        jnp.asarray(accepted, bool),
    )
    h, coords, v, _ = jax.lax.while_loop(cond, body, init)
    return h, coords, v


def _reconstruct(lattice, beta, coords, v, h):
    x_hat = beta * (_point(lattice, coords, v.dtype) + v)
    return jnp.where(h > 0, x_hat, jnp.nan)


def lrsuq_decode(
    layer_key: PRNGKey,
    dither_key: PRNGKey,
    h: jax.Array,
    coords: jax.Array,
    lattice: Lattice,
    noise,
    dtype=None,
    level=None,
) -> jax.Array:
    """LRSUQ decoder of one block: ``x̂ = β (M_h + V_h)`` with ``β`` regenerated from ``layer_key`` and
    ``V_h`` from ``draw_key(dither_key, h)``; ``x̂ − x`` has the law of ``noise``, independent of ``x``.

    Args:
        layer_key: the encoder's latent key.
        dither_key: the encoder's dither key.
        h: the trial index (int scalar; ``h = 0`` decodes to NaN).
        coords: the coordinates of ``M_h``, integer ``[n]``.
        lattice: the encoder's lattice.
        noise: the encoder's noise.
        dtype: float dtype of ``x̂`` (default: the default float dtype; use the encoder input's dtype).
        level: the encoder's ``level`` (:func:`lrsuq_latent`).

    Returns:
        ``x̂ [n]``.

    Raises:
        ValueError: on a bad ``lattice``, ``noise``, ``h`` or ``coords``.
    """
    _check_lattice(lattice)
    _check_noise(noise, lattice)
    coords = _check_coords(coords, lattice)
    h = jnp.asarray(h)
    if h.shape != () or not jnp.issubdtype(h.dtype, jnp.integer):
        raise ValueError(f"h must be an integer scalar, got {h.dtype}{list(h.shape)}")
    dtype = jnp.result_type(float) if dtype is None else dtype
    _, beta = lrsuq_latent(layer_key, lattice, noise, dtype, level)
    v = sample_dither(keys.draw_key(dither_key, h), lattice, dtype)
    return _reconstruct(lattice, beta, coords, v, h)
