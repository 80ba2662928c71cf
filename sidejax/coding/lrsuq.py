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

**LRSUQ** (Definition 4, Proposition 5): shared randomness ``S = (U, (V_i)_{i≥1})``, per block ``j`` of a
message: a latent ``U`` (:func:`lrsuq_latent`) and iid dithers ``V_i`` (:func:`sample_dither`), read by
the counter hash of :mod:`sidejax.coding.counter` from the message's two streams
(:func:`sidejax.keys.lattice_keys`) at (draw, block ``j``) and at (trial ``i``, the block's coordinates), so
the decoder reads ``U`` and ``V_h`` directly. Given ``U`` the superlevel set
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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax import keys
from sidejax.coding.counter import candidate_seeds, combine, coordinate_seeds, counter_uniforms, key_words
from sidejax.distributions import bits_to_open_uniform
from sidejax.lattices import Lattice
from sidejax.types import PRNGKey
from sidejax.utils import check_positive

__all__ = [
    "GaussianNoise",
    "LaplaceNoise",
    "sample_dither",
    "sdq_encode",
    "sdq_decode",
    "latent_draws",
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


def _fold(op, v: jax.Array) -> jax.Array:
    """``op`` over the last axis of ``v`` (a block's ``n ≤ 8`` coordinates, or a latent's few uniforms)
    written as ``n − 1`` elementwise operations: vmapped over blocks they fuse into one loop, where a
    reduction over a minor axis of a few elements is a slow separate loop on XLA's CPU backend."""
    out = v[..., 0]
    for k in range(1, v.shape[-1]):  # static: the lattice dimension
        out = op(out, v[..., k])
    return out


def _point(lattice: Lattice, coords: jax.Array, dtype) -> jax.Array:
    """``(sG) coords`` in ``dtype``: the one expression encoders and decoders use for a lattice point."""
    return lattice.generate(coords.astype(dtype))


class _Dithers(NamedTuple):
    """One block's dither stream, ready for any trial: the dither key's two words and the counter hash's
    coordinate seeds ``a`` of the block's ``n`` coordinates ``j·n … j·n + n − 1``
    (:func:`sidejax.coding.counter.coordinate_seeds`). The seeds do not depend on the trial, so a trial
    loop computes them once, not once per trial."""

    words: tuple
    seeds: jax.Array


def _block_dithers(dither_key, block, n: int) -> _Dithers:
    """The :class:`_Dithers` of block ``block`` (a scalar; or an array of blocks, seeds ``[..., n]``)."""
    words = key_words(dither_key)
    cols = jnp.asarray(block, jnp.uint32)[..., None] * jnp.uint32(n) + jnp.arange(n, dtype=jnp.uint32)
    return _Dithers(words, coordinate_seeds(words, cols))


def _dither(dithers: _Dithers, trial, lattice: Lattice, dtype) -> jax.Array:
    """Trial ``trial``'s dither ``V = u − Q(u)``, ``u = (sG) w``, with ``w`` the counter-hash uniforms at
    (trial, the block's coordinates) (:func:`sample_dither`)."""
    b = candidate_seeds(dithers.words, jnp.asarray(trial, jnp.uint32))
    u = lattice.generate(bits_to_open_uniform(combine(dithers.seeds, b)).astype(dtype))
    q, _ = lattice.nearest(u)
    return u - q


def sample_dither(shared_key: PRNGKey, block, trial, lattice: Lattice, dtype=None) -> jax.Array:
    """Block ``block``'s trial-``trial`` dither ``V ~ Unif(𝒫)``, uniform on the Voronoi cell of ``lattice``.

    ``V = u − Q(u)`` with ``u = (sG) w``, ``w ~ Unif(0, 1)^n``: ``u`` is uniform on the fundamental
    parallelepiped ``sG[0, 1)^n``, and reducing it modulo ``Λ`` onto the Voronoi cell is a measure-preserving
    bijection between two fundamental domains (up to a null set), so ``V`` is uniform on the cell.

    ``w`` is read from the counter hash (:mod:`sidejax.coding.counter`) of the message's dither stream
    (:func:`sidejax.keys.lattice_keys`) at row ``trial`` and columns ``block·n … block·n + n − 1``: every
    (block, trial) pair has its own ``n`` uniforms, and the decoder reads trial ``h`` of block ``j`` directly,
    without the trials before it. The uniforms lie on the grid ``(k + ½)·2^{−23}``; ``V`` is uniform on the
    cell up to that resolution, as any float32 draw is.

    Args:
        shared_key: the message's shared key (client ``i``, round ``t``).
        block: the block index ``j`` (an int or a traced integer scalar; vmap over blocks).
        trial: the trial index ``i ≥ 1`` (SDQ uses trial 1).
        lattice: the lattice.
        dtype: float dtype of ``V`` (default: the default float dtype).

    Returns:
        ``V [n]``.
    """
    _check_lattice(lattice)
    dtype = jnp.result_type(float) if dtype is None else dtype
    dithers = _block_dithers(keys.lattice_keys(shared_key).dither, block, lattice.dim)
    return _dither(dithers, trial, lattice, dtype)


def sdq_encode(shared_key: PRNGKey, block, x: jax.Array, lattice: Lattice) -> jax.Array:
    """Subtractive dithered quantization, encoder: the coordinates of ``M = Q(x − V)``,
    ``V = sample_dither(shared_key, block, 1, lattice)``.

    Args:
        shared_key: the message's shared key (the dither's, shared with the decoder).
        block: the block index ``j`` (vmap over blocks).
        x: one block ``[n]``.
        lattice: the lattice ``Λ`` (``n = lattice.dim``).

    Returns:
        int32 ``coords [n]`` with ``M = generator @ coords``.

    Raises:
        ValueError: if ``lattice`` is not a Lattice or ``x`` is not of shape ``[n]``.
    """
    _check_lattice(lattice)
    x = _check_x(x, lattice)
    v = sample_dither(shared_key, block, 1, lattice, x.dtype)
    _, coords = lattice.nearest(x - v)
    return coords


def sdq_decode(shared_key: PRNGKey, block, coords: jax.Array, lattice: Lattice, dtype=None) -> jax.Array:
    """Subtractive dithered quantization, decoder: ``x̂ = M + V`` with ``M = (sG) coords`` and the
    regenerated dither ``V``; ``x̂ − x ~ Unif(𝒫)``, independent of ``x`` (crypto lemma).

    Args:
        shared_key: the encoder's shared key.
        block: the encoder's block index.
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
    return _point(lattice, coords, dtype) + sample_dither(shared_key, block, 1, lattice, dtype)


def latent_draws(lattice: Lattice, noise) -> int:
    """How many uniforms the latent ``U`` of one block reads (:func:`lrsuq_latent`): ``⌊(n + 2)/2⌋``
    exponentials, plus one Box-Muller pair when ``n`` is odd (Gaussian); two exponentials (Laplace)."""
    _check_noise(noise, lattice)
    if isinstance(noise, LaplaceNoise):
        return 2
    n = lattice.dim
    if n > 8:
        raise ValueError(f"lattice: LRSUQ's latent supports dimensions up to 8, got {lattice.name}")
    return (n + 2) // 2 + 2 * (n % 2)


def _latent(layer_key, block, lattice: Lattice, noise, dtype, level):
    """``(r, β)`` of :func:`lrsuq_latent` from the layer stream's key."""
    tiny = jnp.finfo(dtype).tiny
    m = latent_draws(lattice, noise)
    u = counter_uniforms(layer_key, jnp.arange(m, dtype=jnp.uint32), jnp.asarray(block, jnp.uint32))
    u = u.astype(dtype)
    if isinstance(noise, GaussianNoise):
        pairs = (lattice.dim + 2) // 2
        # −2 Σ log u_k, a sum of χ²_2 terms, as one logarithm of the product (at most 5 uniforms ≥ 2^−24
        # each for n ≤ 8: the product stays a normal float32, ≥ 2^−120)
        chi2 = -2.0 * jnp.log(_fold(jnp.multiply, u[:pairs]))
        if lattice.dim % 2:  # χ²_{n+2} = χ²_{n+1} + Z², Z = √(−2 log u) cos(2π v) (Box-Muller)
            chi2 = chi2 - 2.0 * jnp.log(u[pairs]) * jnp.square(jnp.cos(2.0 * math.pi * u[pairs + 1]))
        scale = noise.sigma if level is None else jnp.asarray(level, dtype)
        r = scale * jnp.sqrt(jnp.maximum(chi2, tiny))
    else:
        gamma2 = -jnp.log(u[0] * u[1])  # −log u₀ − log u₁: Exp(1) + Exp(1) = Gamma(2, 1)
        scale = noise.b if level is None else jnp.asarray(level, dtype)
        r = scale * jnp.maximum(gamma2, tiny)
    return r, r / lattice.packing_radius


def lrsuq_latent(
    shared_key: PRNGKey, block, lattice: Lattice, noise, dtype=None, level=None
) -> tuple[jax.Array, jax.Array]:
    """The shared latent of LRSUQ block ``block``: the radius ``r`` of the superlevel set and the scale
    ``β = r/ρ``.

    Gaussian ``N(0, σ²I_n)``: ``U ~ χ²_{n+2}``, ``r = σ√U``. Laplace ``Lap(0, b)``: ``U ~ Gamma(2, 1)``,
    ``r = bU``. ``U`` is a fixed function of :func:`latent_draws` uniforms ``u_k`` read from the counter hash
    (:mod:`sidejax.coding.counter`) of the message's layer stream (:func:`sidejax.keys.lattice_keys`) at
    (draw ``k``, block ``block``): no rejection loop, so vmapped over blocks every block costs the same.

    * ``−log u`` with ``u ~ Unif(0, 1)`` is ``Exp(1)`` (``P(−log u > t) = P(u < e^{−t}) = e^{−t}``), so
      ``−2 log u ~ χ²_2`` (``χ²_2`` is ``Exp`` of mean 2), and a sum of ``m`` independent ``χ²_2`` is
      ``χ²_{2m}``.
    * Gaussian, ``n`` even: ``U = −2 Σ_{k<(n+2)/2} log u_k ~ χ²_{n+2}``.
    * Gaussian, ``n`` odd: ``χ²_{n+2} = χ²_{n+1} + χ²_1``, the first as above with ``(n + 1)/2`` terms and the
      second ``Z²`` with ``Z = √(−2 log u_a) cos(2π u_b)`` standard normal (Box-Muller: ``(R, θ)`` with
      ``R² ~ χ²_2`` and ``θ`` uniform independent is the polar form of two iid standard normals).
    * Laplace: ``Gamma(2, 1)`` is the law of ``E₁ + E₂`` with ``E_k`` iid ``Exp(1)``, so ``U = −log u₀ −
      log u₁``.

    Exact up to the resolution of the float32 uniforms, which lie on the grid ``(k + ½)·2^{−23}`` (never 0
    or 1, so every logarithm is finite): each exponential is capped at ``24 log 2 ≈ 16.6`` (the mass
    ``2^{−24}`` of its lowest cell sitting at the cell's midpoint), and ``|Z| ≤ 5.8``. ``U`` is kept at
    least the smallest normal float (``U = 0`` has probability zero; it would make ``β = 0``).

    Args:
        shared_key: the message's shared key (shared with the decoder).
        block: the block index ``j`` (vmap over blocks).
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
    return _latent(keys.lattice_keys(shared_key).layer, block, lattice, noise, dtype, level)


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
    shared_key: PRNGKey, block, x: jax.Array, lattice: Lattice, noise
) -> tuple[jax.Array, jax.Array]:
    """LRSUQ encoder of block ``block``: rejection-sample dithers until the scaled residual lies in the ball.

    With ``(r, β) = lrsuq_latent(shared_key, block, …)`` and ``V_i = sample_dither(shared_key, block, i, …)``,
    trial ``i = 1, 2, …`` computes ``y_i = x/β − V_i``, ``M_i = Q(y_i)`` and accepts iff
    ``||M_i − y_i||_2 ≤ r/β = ρ`` (tested as ``Σ(M_i − y_i)² ≤ ρ²``). A ``lax.while_loop`` with no cap:
    ``h ~ Geom(p)`` (:func:`acceptance_probability`).

    Args:
        shared_key: the message's shared key (its latent and dither streams, shared with the decoder).
        block: the block index ``j`` (vmap over blocks: each block has its own latent and dithers).
        x: one block ``[n]``.
        lattice: the lattice.
        noise: :class:`GaussianNoise` or :class:`LaplaceNoise`.

    Returns:
        ``(h, coords)``: the int32 trial index ``h ≥ 1`` (``0`` if ``x`` could not be encoded: not finite,
        or ``x/β`` beyond the int32 coordinate range) and the int32 coordinates ``[n]`` of ``M_h``.

    Raises:
        ValueError: on a bad ``lattice``, ``noise`` or ``x`` shape.
    """
    h, coords, _ = _lrsuq_encode(shared_key, block, x, lattice, noise)
    return h, coords


def _lrsuq_encode(shared_key, block, x, lattice, noise, level=None):
    """:func:`lrsuq_encode` plus the encoder's own reconstruction ``β(M_h + V_h)`` (for tests); ``level``
    as in :func:`lrsuq_latent`. The per-block reference of the vector encoder
    :func:`sidejax.coding.lattice.lrsuq_quantize` (which must return the same ``(h, coords)`` bit for bit)."""
    _check_lattice(lattice)
    _check_noise(noise, lattice)
    x = _check_x(x, lattice)
    streams = keys.lattice_keys(shared_key)
    beta, xs, ok = _scaled_input(streams.layer, block, x, lattice, noise, level)
    dithers = _block_dithers(streams.dither, block, lattice.dim)
    h, coords, v = _trial_loop(dithers, xs, lattice, jnp.int32(0), ~ok)
    x_hat = _reconstruct(lattice, beta, coords, v, h)
    return h, coords, x_hat


def _scaled_input(layer_key, block, x, lattice, noise, level):
    """``(β, x/β, ok)`` of one block: the scale from :func:`lrsuq_latent`, the scaled input, and whether
    trials can be tested (``x/β`` finite and within the int32 coordinate range)."""
    _, beta = _latent(layer_key, block, lattice, noise, x.dtype, level)
    xs = x / beta
    ok = _fold(jnp.logical_and, jnp.isfinite(xs) & (jnp.abs(xs) < _COORD_LIMIT * lattice.scale))
    return beta, xs, ok


def _trial(dithers, xs, i, lattice):
    """Trial ``i`` of a block with scaled input ``xs = x/β`` and dither stream ``dithers``
    (:class:`_Dithers`): ``(coords of M_i, V_i, accepted)`` with ``V_i`` the block's trial-``i`` dither,
    ``M_i = Q(xs − V_i)`` and acceptance iff ``Σ(M_i − (xs − V_i))² ≤ ρ²``."""
    dtype = xs.dtype
    v = _dither(dithers, i, lattice, dtype)
    y = xs - v
    _, coords = lattice.nearest(y)
    if lattice.dim == 1:
        # On a one-dimensional lattice the ball of radius ρ = s/2 is the whole cell: every trial accepts in
        # exact arithmetic (p = 1), and the stream sends no trial index (the decoder takes h = 1). The test
        # is not computed: a float32 rounding of the residual must not reject the trial (with a scale that
        # is not a power of two that kept trial 2 while the decoder rebuilt trial 1, and for |x/β| an odd
        # integer in [2^23, 2^24) every trial was rejected and the encoder never stopped).
        return coords, v, jnp.asarray(True)
    e = _point(lattice, coords, dtype) - y
    return coords, v, _fold(jnp.add, jnp.square(e)) <= lattice.packing_radius**2


def _trial_loop(dithers, xs, lattice, start, accepted):
    """Trials ``start + 1, start + 2, …`` of a block (its dither stream ``dithers``) until one accepts (a
    ``lax.while_loop`` with no cap); none runs when ``accepted`` is already True. Returns ``(h, coords,
    V_h)``: the accepted trial's index, coordinates and dither, or ``(start, 0, 0)`` when no trial ran."""
    dtype = xs.dtype

    def cond(state):
        return ~state[3]

    def body(state):
        i = state[0] + 1
        coords, v, ok = _trial(dithers, xs, i, lattice)
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
    shared_key: PRNGKey,
    block,
    h: jax.Array,
    coords: jax.Array,
    lattice: Lattice,
    noise,
    dtype=None,
    level=None,
) -> jax.Array:
    """LRSUQ decoder of block ``block``: ``x̂ = β (M_h + V_h)`` with ``β`` and the trial-``h`` dither ``V_h``
    regenerated from the shared key; ``x̂ − x`` has the law of ``noise``, independent of ``x``.

    Args:
        shared_key: the encoder's shared key.
        block: the encoder's block index.
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
    return _decode(keys.lattice_keys(shared_key), block, h, coords, lattice, noise, dtype, level)


def _decode(streams, block, h, coords, lattice, noise, dtype, level):
    """:func:`lrsuq_decode` from the message's stream keys (:func:`sidejax.keys.lattice_keys`)."""
    _, beta = _latent(streams.layer, block, lattice, noise, dtype, level)
    v = _dither(_block_dithers(streams.dither, block, lattice.dim), h, lattice, dtype)
    return _reconstruct(lattice, beta, coords, v, h)
