r"""CEPAM's mechanisms as coders: LRSUQ (quantization noise that *is* Gaussian or Laplace DP noise), SDQ,
additive-noise baselines and the update normalisation of Algorithm 2.

The per-block quantizers are in :mod:`sidejax.coding.lrsuq`; this module applies them to a whole vector and
writes real streams (docs/papers/cepam.md#s2-6).

**Blocks and keys.** A vector of ``d`` coordinates is zero-padded to ``N·n`` (``N = ceil(d/n)``, ``n`` the
lattice dimension) and cut into contiguous blocks (docs/papers/cepam.md#s6-22). The message encoded with the
shared key ``s`` (client ``i``, round ``t``) has two streams, ``lattice_keys(s).layer`` and ``.dither``
(:func:`sidejax.keys.lattice_keys`), read by the counter hash (:mod:`sidejax.coding.counter`): block ``j``'s
latent from the layer stream at (draw ``k``, block ``j``), its trial-``i`` dither from the dither stream at
(trial ``i``, coordinates ``j·n … j·n + n − 1``). The decoder regenerates both from ``s``; no key is derived
per block or per trial.

**Stream** (:func:`encode_lattice_stream`), all codewords most-significant bit first:

1. the trial indices ``h_j`` (``N`` Golomb codewords of ``h_j − 1`` with the parameter
   ``m_h = ceil(log(2 − p)/(−log(1 − p)))`` of the geometric law ``Geom(p)``, ``p`` the acceptance
   probability, Gallager and Van Voorhis 1975: unary for ``Z^2, Z^3, A2, D4``, ``m_h = 2`` for ``E8``). When
   ``p = 1`` (``Z^1``, Laplace) ``h ≡ 1`` and nothing is sent.
2. a header: the number ``k`` of nonzero lattice coordinates and the run-length Golomb parameter ``m``, each
   in ``W = (N n).bit_length()`` bits.
3. for each nonzero coordinate ``c`` in order: the Golomb code (parameter ``m``) of the run of zeros before
   it, the Elias-gamma code of ``|c|`` and one sign bit (1 = negative).

The coordinates of a low-SNR update are mostly zero, so the run-length part costs about the binary entropy of
the nonzero density plus two bits per nonzero coordinate. ``num_bits`` is the exact length written;
``ideal_bits`` (reported beside it, labelled ideal) is ``N·h₂(p)/p`` (the entropy of the trial indices)
plus ``N n`` times the order-0 empirical entropy of the coordinates (what an adaptive arithmetic coder
approaches). The paper gives no measured rate (docs/papers/cepam.md#s2-10); both are real measurements here.

**Capacity.** Inside ``jit`` a message lives in a static buffer (:func:`lattice_stream_capacity_words`):
``capacity_bits_per_coordinate`` bits per coordinate, the two header fields, and the trial indices. The
Golomb codeword of ``h_j − 1`` (parameter ``m = m_h``) has ``q_j + 1 + r_j`` bits with the quotient
``q_j = ⌊(h_j − 1)/m⌋`` and ``r_j ≤ ⌈log₂ m⌉`` remainder bits. Since ``h_j − 1`` is geometric
(``P(h_j − 1 ≥ k) = (1 − p)^k``), ``P(q_j ≥ k) = (1 − p)^{km}``: the quotients are iid geometric with
success probability ``p' = 1 − (1 − p)^m``, and their sum over the ``N`` blocks is negative binomial
``NB(N, p')``. The trial part of the buffer is ``T + N(1 + ⌈log₂ m⌉)`` bits with ``T`` the smallest
integer with ``P(Σ_j q_j > T) ≤ 10^{−18}`` (the exact negative-binomial tail, ``scipy.stats.nbinom.logsf``,
on the host; the Chernoff bound ``P(S ≥ t) ≤ min_s E[e^{sS}] e^{−st}`` gives a ``T`` within 1 % of it at
these sizes). For ``d = 25,818`` that is 4,134 quotient bits for ``Z^2`` (mean 3,527) instead of the former
flat 64 per block (826,176), and 4,942 for ``E8`` (mean 4,059). So a message overflows through its trial
indices with probability at most ``10^{−18}``; a message that does not fit (that, or a tiny noise level
against a large update filling the coordinate part) is never truncated: the encoder reports
``valid = False`` and ``LatticeInfo.overflow``, and the error names the parameter to raise.

**Coders.** ``q`` is the point mass at the vector to send, ``p`` the side information both ends know: a
:class:`~sidejax.distributions.PointMass` at the reference point (the global model), or a
:class:`NoisePrior` that also carries this client's noise level (privacy adaptability,
docs/papers/cepam.md#s2-12). Every coder sends ``q − center`` and decodes to ``center + (decoded update)``.

* :func:`lrsuq_coder`: CEPAM's quantizer, error exactly ``N(0, σ²)`` or ``Lap(0, b)`` (Proposition 5).
* :func:`sdq_coder`: subtractive dithered quantization, error ``Unif(𝒫)`` (FL+SDQ).
* :func:`additive_noise_coder`: private Gaussian/Laplace noise added before an inner coder
  (FL+Gaussian, FL+Laplace with :func:`sidejax.coding.float32_coder`; FL+Gaussian+SDQ with :func:`sdq_coder`).
* :func:`clip_update`: Algorithm 2's normalisation ``X̃ = γX/||X||`` with the norm sent as float32 and the
  server's rescaling by ``||X||/γ`` (``mode="normalise"``, the paper), or the DP-correct clipping
  ``X̃ = X·min(1, γ/||X||)`` without rescaling (``mode="clip"``, docs/papers/cepam.md#s6-3).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax import keys as keymod
from sidejax.bits import as_bits
from sidejax.coding.base import (
    Coder,
    Message,
    StreamCheck,
    concat_after_float32,
    decode_float32,
    failed_checks,
    float32_coder,
    split_message,
    stateless_coder,
    wrap_coder,
)
from sidejax.coding.bitstream import (
    INVALID_LENGTH,
    elias_gamma_codeword,
    elias_gamma_decode_at,
    golomb_codeword,
    golomb_decode_at,
    jump_codewords,
    mask_to_length,
    prefix_sum,
    read_bits,
    read_bits_at,
    resolve_chain_method,
    set_bit_positions,
    stream_view,
    walk_symbol_fields,
    walk_symbols,
    write_codewords,
)
from sidejax.coding.lossless import MAX_STREAM_BITS, _gaps, _positions_from_gaps, optimal_golomb_parameter
from sidejax.coding.lrsuq import (
    GaussianNoise,
    LaplaceNoise,
    _block_dithers,
    _decode,
    _dither,
    _Dithers,
    _point,
    _scaled_input,
    _trial,
    _trial_loop,
    acceptance_probability,
)
from sidejax.distributions import PointMass
from sidejax.lattices import Lattice
from sidejax.utils import check_positive

__all__ = [
    "NoisePrior",
    "LatticeInfo",
    "num_blocks",
    "lattice_blocks",
    "lrsuq_quantize",
    "lrsuq_reconstruct",
    "sdq_quantize",
    "sdq_reconstruct",
    "trial_golomb_parameter",
    "lattice_stream_capacity_words",
    "trial_index_capacity_bits",
    "encode_lattice_stream",
    "decode_lattice_stream",
    "lrsuq_coder",
    "sdq_coder",
    "additive_noise_coder",
    "clip_update",
]

# a message overflows its buffer through its trial indices with at most this probability (module docstring,
# "Capacity")
_TRIAL_TAIL = 1e-18


class NoisePrior(NamedTuple):
    """Side information of a private coder: the reference point and this client's noise level.

    Attributes:
      center: the reference point ``[d]`` (the global model): coders send ``q − center``.
      level: the noise level (``σ`` for Gaussian noise, ``b`` for Laplace noise), a positive scalar agreed
        by the client and the server at initialisation (docs/papers/cepam.md#s2-12); it replaces the coder's
        own level.
    """

    center: jax.Array
    level: jax.Array


def _center_level(p):
    """``(center, level)`` of ``p``; ``level`` is ``None`` for a :class:`PointMass` (the coder's own)."""
    if isinstance(p, NoisePrior):
        return jnp.asarray(p.center), jnp.asarray(p.level, jnp.float32)
    if isinstance(p, PointMass):
        return jnp.asarray(p.value), None
    raise ValueError(
        f"p must be a PointMass (the reference point) or a NoisePrior (reference point and noise level), "
        f"got {type(p).__name__}"
    )


def _like(p, center):
    """``p``'s type with another center (the level kept)."""
    return p._replace(center=center) if isinstance(p, NoisePrior) else PointMass(center)


class LatticeInfo(NamedTuple):
    """Encoder diagnostics.

    Attributes:
      valid: the input was finite, every block was encoded and the stream fits its buffer.
      ideal_bits: ``N·h₂(p)/p`` plus ``N n`` times the order-0 empirical entropy of the coordinates (an
        ideal rate, labelled as such; ``num_bits`` is the real one).
      mean_trials: the mean trial index ``h`` over the blocks (``1/p`` in expectation).
      overflow: the stream did not fit the static buffer (raise ``capacity_bits_per_coordinate``).
    """

    valid: jax.Array
    ideal_bits: jax.Array
    mean_trials: jax.Array
    overflow: jax.Array


def _check_lattice(lattice) -> Lattice:
    if not isinstance(lattice, Lattice):
        raise ValueError(f"lattice must be a sidejax.lattices.Lattice, got {type(lattice).__name__}")
    return lattice


def num_blocks(dim: int, lattice: Lattice) -> int:
    """``N = ceil(dim / n)``: the number of lattice blocks of a ``dim``-vector (the last one zero-padded)."""
    return -(-int(dim) // _check_lattice(lattice).dim)


def lattice_blocks(x: jax.Array, lattice: Lattice) -> jax.Array:
    """``x [d]`` zero-padded to ``N·n`` and cut into contiguous blocks ``[N, n]`` (docs/papers/cepam.md#s2-7:
    pad, don't crash, when ``n`` does not divide ``d``)."""
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"x must be a flat vector [d], got shape {x.shape}")
    n = _check_lattice(lattice).dim
    blocks = num_blocks(x.shape[0], lattice)
    return jnp.pad(x, (0, blocks * n - x.shape[0])).reshape(blocks, n)


def lrsuq_quantize(shared_key, x: jax.Array, lattice: Lattice, noise, level=None):
    """LRSUQ of a whole vector: every block through :func:`sidejax.coding.lrsuq.lrsuq_encode` with its own
    latent and dithers (the message's streams of :func:`sidejax.keys.lattice_keys`, read per block by the
    counter hash), vectorised over blocks.

    The output is bit for bit that of ``vmap(lrsuq_encode)`` over the blocks, at a fraction of its cost: a
    vmapped ``while_loop`` runs every block for as many trials as the slowest one needs (``max h``, 32 for
    ``E8`` where ``E[h] = 3.9``), so the trials are run in two phases (:func:`_straggler_plan` picks ``T0``
    and ``cap`` from the acceptance probability ``p`` and the block count ``N``):

    1. trials ``1 … T0`` for all ``N`` blocks (a ``while_loop`` that stops at ``T0`` or when every block
       has accepted), each block keeping its first accepted trial;
    2. while some block has not accepted: its index is gathered into a static buffer of ``cap`` slots
       (``jnp.nonzero(size=cap)``; at most ``cap`` blocks per round) and those blocks continue from trial
       ``T0 + 1`` with the uncapped per-block loop until each accepts, then are scattered back. Normally
       one round finishes all of them (``cap`` is far above the expected ``N(1 − p)^{T0}`` stragglers);
       when more are left, further rounds take the rest, so the sampler stays exact with no cap on the
       number of trials (and, unlike a ``lax.cond`` fallback, costs nothing extra under an outer ``vmap``).

    Every block runs the same trials ``1, 2, …`` with the same keys as the per-block encoder and stops at
    the same first accepted one, so ``(h, coords)`` are identical.

    When ``T0 = 1`` (``p = 1``: ``Z^1`` and Laplace; also ``A2`` at most sizes) phase 1 is one vectorised
    trial with no loop around it, and phase 2 is a loop whose condition is false at once in practice. For
    ``p = 1`` (a one-dimensional lattice) the first trial accepts in exact arithmetic: the ball of radius
    ``ρ = s/2`` is the whole cell ``s[−1/2, 1/2]``. Float32 rounding of the residual could reject it (a scale
    that is not a power of two, or ``|x/β| ≥ 2^23``), so the trial test itself accepts every trial of a
    one-dimensional lattice (:func:`sidejax.coding.lrsuq._trial`): the stream sends no trial index there and
    the decoder rebuilds trial 1. Phase 2 stays for ``A2``, whose ``p < 1``; for ``p = 1`` its loop never
    runs.

    Args:
      shared_key: the key shared by the client and the server for this message.
      x: the vector ``[d]`` (float).
      lattice: the lattice (dimension ``n``).
      noise: :class:`~sidejax.coding.lrsuq.GaussianNoise` or :class:`~sidejax.coding.lrsuq.LaplaceNoise`.
      level: optional traced noise level replacing the noise's own (:class:`NoisePrior`).

    Returns:
      ``(h [N], coords [N, n])`` int32: trial indices (``0`` for a block that could not be encoded: a
      non-finite input or one beyond the int32 coordinate range) and lattice coordinates.
    """
    xb = lattice_blocks(x, lattice)
    if not jnp.issubdtype(xb.dtype, jnp.floating):
        xb = xb.astype(jnp.result_type(float))
    t0, cap = _straggler_plan(acceptance_probability(lattice, noise), xb.shape[0])
    return _lrsuq_quantize_blocks(keymod.lattice_keys(shared_key), xb, lattice, noise, level, t0, cap)


def _straggler_plan(p: float, blocks: int) -> tuple[int, int]:
    r"""``(T0, cap)`` of :func:`lrsuq_quantize`'s two phases for acceptance probability ``p`` and ``N``
    blocks (host side, static).

    With ``q = 1 − p`` the trial index of a block is ``Geom(p)``, so ``P(h > t) = q^t`` and the slowest of
    ``N`` blocks has ``P(max h ≥ m) = 1 − (1 − q^{m−1})^N``. About ``K = N q^{T0}`` blocks are left after
    phase 1 (a Binomial count, standard deviation ``< √K``); ``cap = min(N, ⌈2K⌉ + 64)`` leaves a margin of
    ``K + 64`` over that mean (more than ``√K + 64`` standard deviations), so a second round is
    astronomically rare. ``T0`` minimises the expected number of block-trials computed,

    .. math::

        C(T0) = N\,Σ_{m=1}^{T0} P(\max h ≥ m) + \mathrm{cap}(T0)\,Σ_{m>T0} P(\max h ≥ m),

    phase 1 (every block, until ``T0`` or all accept) plus phase 2 (``cap`` slots until the slowest
    straggler accepts), over ``T0 = 1 … T_max`` with ``N q^{T_max} ≤ 10^{−3}``. For ``d = 25,818``:
    ``Z^2`` ``T0 = 2``, ``Z^3`` 4, ``A2`` 1, ``D4`` 3, ``E8`` 9, about a third of the block-trials of the
    plain vmapped loop. ``p = 1`` (``Z^1``, Laplace): ``T0 = 1``, ``cap = min(N, 64)`` (no stragglers).
    """
    q = 1.0 - p
    if q <= 0.0:
        return 1, min(blocks, 64)

    def p_max_at_least(m):
        return 1.0 if m <= 1 else -math.expm1(blocks * math.log1p(-(q ** (m - 1))))

    t_max = 1
    while blocks * q**t_max > 1e-3:
        t_max += 1
    ps = [p_max_at_least(m) for m in range(1, t_max + 2)]
    m = t_max + 2
    while ps[-1] > 1e-12:
        ps.append(p_max_at_least(m))
        m += 1
    best = None
    for t0 in range(1, t_max + 1):
        cap = min(blocks, math.ceil(2.0 * blocks * q**t0) + 64)
        cost = blocks * sum(ps[:t0]) + cap * sum(ps[t0:])
        if best is None or cost < best[0]:
            best = (cost, t0, cap)
    return best[1], best[2]


def _lrsuq_quantize_blocks(streams, xb, lattice: Lattice, noise, level, t0: int, cap: int):
    """:func:`lrsuq_quantize` of the blocks ``xb [N, n]`` with the message's stream keys
    (:func:`sidejax.keys.lattice_keys`) and a given static plan ``(T0, cap)`` (any ``T0 ≥ 1``,
    ``1 ≤ cap ≤ N``: the output does not depend on them)."""
    blocks, n = xb.shape
    index = jnp.arange(blocks, dtype=jnp.int32)
    _, xs, ok = jax.vmap(lambda j, b: _scaled_input(streams.layer, j, b, lattice, noise, level))(index, xb)
    dithers = _block_dithers(streams.dither, index, n)  # every block's seeds, once for all trials
    axes = _Dithers(words=None, seeds=0)
    trials = jax.vmap(lambda dt, y, i: _trial(dt, y, i, lattice)[::2], (axes, 0, None))

    def cond1(state):
        i, _, _, done = state
        return (i < t0) & ~jnp.all(done)

    def body1(state):
        i, h, coords, done = state
        i = i + 1
        c, accepted = trials(dithers, xs, i)
        new = accepted & ~done
        return i, jnp.where(new, i, h), jnp.where(new[:, None], c, coords), done | new

    init = (jnp.int32(0), jnp.zeros((blocks,), jnp.int32), jnp.zeros((blocks, n), jnp.int32), ~ok)
    if t0 == 1:  # Z^1, Laplace, A2: trial 1 of every block, straight (the loop would stop after it anyway)
        t, h, coords, done = body1(init)
    else:
        t, h, coords, done = jax.lax.while_loop(cond1, body1, init)

    def cond2(state):
        return ~jnp.all(state[2])

    def body2(state):
        h, coords, done = state
        (idx,) = jnp.nonzero(~done, size=cap, fill_value=blocks)
        live = idx < blocks
        j = jnp.where(live, idx, 0)
        late = _Dithers(dithers.words, dithers.seeds[j])
        hj, cj, _ = jax.vmap(lambda dt, y, a: _trial_loop(dt, y, lattice, t, a), (axes, 0, 0))(
            late, xs[j], ~live
        )
        return (
            h.at[idx].set(hj, mode="drop"),
            coords.at[idx].set(cj, mode="drop"),
            done.at[idx].set(True, mode="drop"),
        )

    h, coords, _ = jax.lax.while_loop(cond2, body2, (h, coords, done))
    return h, coords


def lrsuq_reconstruct(
    shared_key, h, coords, lattice: Lattice, noise, dim: int, level=None, dtype=jnp.float32
):
    """The decoder of :func:`lrsuq_quantize`: ``x̂ = β_j (M_j + V_{j,h_j})`` per block, padding dropped; the
    error ``x̂ − x`` is iid ``noise`` over the ``d`` coordinates, independent of ``x`` (Proposition 5)."""
    streams = keymod.lattice_keys(shared_key)
    index = jnp.arange(num_blocks(dim, lattice), dtype=jnp.int32)
    out = jax.vmap(lambda j, hj, cj: _decode(streams, j, hj, cj, lattice, noise, dtype, level))(
        index, jnp.asarray(h, jnp.int32), jnp.asarray(coords, jnp.int32)
    )
    return out.reshape(-1)[:dim]


def sdq_quantize(shared_key, x: jax.Array, lattice: Lattice) -> jax.Array:
    """Subtractive dithered quantization of a vector: block ``j`` sends the coordinates of
    ``Q(x_j − V_j)`` with ``V_j`` its trial-1 dither (:func:`sidejax.coding.lrsuq.sample_dither`).
    int32 ``[N, n]``."""
    xb = lattice_blocks(x, lattice)
    dithers = _block_dithers(keymod.lattice_keys(shared_key).dither, jnp.arange(xb.shape[0]), lattice.dim)

    def one(dt, b):
        return lattice.nearest(b - _dither(dt, 1, lattice, b.dtype))[1]

    return jax.vmap(one, (_Dithers(words=None, seeds=0), 0))(dithers, xb)


def sdq_reconstruct(shared_key, coords, lattice: Lattice, dim: int, dtype=jnp.float32) -> jax.Array:
    """The decoder of :func:`sdq_quantize`: ``M_j + V_j``, padding dropped; error ``Unif(𝒫)`` (crypto
    lemma)."""
    blocks = jnp.arange(num_blocks(dim, lattice))
    dithers = _block_dithers(keymod.lattice_keys(shared_key).dither, blocks, lattice.dim)

    def one(dt, c):
        return _point(lattice, c, dtype) + _dither(dt, 1, lattice, dtype)

    coords = jnp.asarray(coords, jnp.int32)
    return jax.vmap(one, (_Dithers(words=None, seeds=0), 0))(dithers, coords).reshape(-1)[:dim]


def trial_golomb_parameter(p: float) -> int:
    """The optimal Golomb parameter of ``h − 1`` for ``h ~ Geom(p)``: ``ceil(log(2 − p) / (−log(1 − p)))``;
    ``0`` when ``p = 1`` (no trial index is sent)."""
    if p >= 1.0:
        return 0
    return max(1, math.ceil(math.log(2.0 - p) / -math.log1p(-p) - 1e-12))


def _check_capacity_per_coordinate(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 4 <= value <= 96:
        raise ValueError(f"capacity_bits_per_coordinate must be an integer in [4, 96], got {value!r}")
    return int(value)


def lattice_stream_capacity_words(
    blocks: int, n: int, trial_m: int, capacity_bits_per_coordinate: int, *, acceptance: float | None = None
) -> int:
    """Static word capacity of a lattice stream of ``blocks`` blocks of dimension ``n``.

    ``capacity_bits_per_coordinate`` bits per coordinate, the header, and for the trial indices
    (``trial_m > 0``) :func:`trial_index_capacity_bits` (overflow probability ``≤ 10^{−18}``, module
    docstring "Capacity"), plus one spare word.

    Args:
      blocks: the number of blocks ``N``.
      n: the lattice dimension.
      trial_m: the Golomb parameter of ``h − 1`` (:func:`trial_golomb_parameter`); 0: no trial indices.
      capacity_bits_per_coordinate: bits per coordinate, an integer in ``[4, 96]``.
      acceptance: the acceptance probability ``p`` of the trials (``h ~ Geom(p)``); ``None``: the smallest
        ``p`` for which ``trial_m`` is the optimal parameter (the heaviest quotient tail, a bound for every
        such ``p``).

    Raises:
      ValueError: on bad arguments, or beyond :data:`sidejax.coding.lossless.MAX_STREAM_BITS`.
    """
    cap = _check_capacity_per_coordinate(capacity_bits_per_coordinate)
    width = (blocks * n).bit_length()
    trials = trial_index_capacity_bits(blocks, trial_m, acceptance) if trial_m else 0
    bits = trials + 2 * width + blocks * n * cap
    if bits > MAX_STREAM_BITS:
        raise ValueError(
            f"a lattice stream of {blocks * n} coordinates needs a buffer of {bits} bits, more than the "
            f"{MAX_STREAM_BITS} supported: lower capacity_bits_per_coordinate "
            f"(now {cap}) or send the model in several messages"
        )
    return -(-bits // 32) + 1


def trial_index_capacity_bits(blocks: int, trial_m: int, acceptance: float | None = None) -> int:
    """Bits reserved for ``N = blocks`` Golomb-coded trial indices: ``T + N(1 + ⌈log₂ m⌉)`` with ``T`` the
    smallest integer such that ``P(Σ_j q_j > T) ≤ 10^{−18}``, where the quotients
    ``q_j = ⌊(h_j − 1)/m⌋`` of ``h_j ~ Geom(p)`` are iid geometric with success probability
    ``p' = 1 − (1 − p)^m``, so ``Σ_j q_j ~ NB(N, p')`` (exact tail, ``scipy.stats.nbinom``; module docstring
    "Capacity").

    Args:
      blocks: the number of trial indices ``N ≥ 1``.
      trial_m: their Golomb parameter ``m ≥ 1``.
      acceptance: the acceptance probability ``p ∈ (0, 1]``; ``None``: the smallest ``p`` for which ``m``
        is optimal (Gallager and Van Voorhis: ``m`` is optimal iff ``q^m(1 + q) ≤ 1 < q^{m−1}(1 + q)``
        with ``q = 1 − p``; at the largest such ``q``, ``q^m = 1/(1 + q)`` and ``p' = q/(1 + q)``, the
        smallest quotient success probability over those ``p``).

    Raises:
      ValueError: if ``blocks < 1``, ``trial_m < 1`` or ``acceptance`` is not in ``(0, 1]``.
    """
    if isinstance(blocks, bool) or not isinstance(blocks, numbers.Integral) or blocks < 1:
        raise ValueError(f"blocks must be an integer >= 1, got {blocks!r}")
    if isinstance(trial_m, bool) or not isinstance(trial_m, numbers.Integral) or trial_m < 1:
        raise ValueError(f"trial_m must be an integer >= 1, got {trial_m!r}")
    if acceptance is None:
        quotient_p = _worst_quotient_probability(int(trial_m))
    else:
        if (
            isinstance(acceptance, bool)
            or not isinstance(acceptance, numbers.Real)
            or not (0.0 < acceptance <= 1.0)
        ):
            raise ValueError(f"acceptance must be a probability in (0, 1], got {acceptance!r}")
        quotient_p = -math.expm1(int(trial_m) * math.log1p(-float(acceptance))) if acceptance < 1 else 1.0
    quotients = _negative_binomial_bound(int(blocks), quotient_p)
    return quotients + int(blocks) * (1 + (int(trial_m) - 1).bit_length())


@functools.cache
def _worst_quotient_probability(m: int) -> float:
    """``q*/(1 + q*)`` with ``q*`` the root of ``q^m(1 + q) = 1`` in ``(0, 1)`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mid**m * (1.0 + mid) < 1.0 else (lo, mid)
    return lo / (1.0 + lo)


@functools.cache
def _negative_binomial_bound(blocks: int, quotient_p: float) -> int:
    """The smallest ``T`` with ``P(S > T) ≤ 10^{−18}`` for ``S ~ NB(blocks, quotient_p)`` (the number of
    failures before the ``blocks``-th success), by bisection on ``scipy.stats.nbinom.logsf``."""
    from scipy import stats

    if quotient_p >= 1.0:
        return 0
    target = math.log(_TRIAL_TAIL)

    def small(t):
        return stats.nbinom.logsf(t, blocks, quotient_p) <= target

    hi = max(64, 2 * math.ceil(blocks * (1.0 - quotient_p) / quotient_p))
    while not small(hi):
        hi *= 2
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if small(mid) else (mid + 1, hi)
    return lo


# compiled once per shape and parameters (no key is derived inside), so that eager calls do not dispatch op
# by op; inside an outer jit or vmap they are inlined
@functools.partial(jax.jit, static_argnames=("trial_m", "capacity_words"))
def encode_lattice_stream(h: jax.Array, coords: jax.Array, *, trial_m: int, capacity_words: int):
    """Writes trial indices and lattice coordinates as one stream (layout in the module docstring).

    Args:
      h: int ``[N]`` trial indices ``>= 1`` (ignored when ``trial_m == 0``).
      coords: int ``[N, n]`` lattice coordinates.
      trial_m: Golomb parameter of ``h − 1`` (:func:`trial_golomb_parameter`); 0: not sent.
      capacity_words: static buffer size (:func:`lattice_stream_capacity_words`).

    Returns:
      ``(words, num_bits, fits)``: uint32 ``[capacity_words]``, the stream length (int32) and whether it
      fits the buffer (when False the message is unusable and must be flagged invalid).
    """
    coords = jnp.asarray(coords, jnp.int32)
    flat = coords.reshape(-1)
    dim = flat.shape[0]
    width = dim.bit_length()
    nonzero = flat != 0
    k = jnp.sum(nonzero, dtype=jnp.int32)
    m = optimal_golomb_parameter(k, dim)
    run_v, run_l = golomb_codeword(jnp.maximum(_gaps(nonzero) - 1, 0), m, bound=dim + 1)  # zeros before each
    mag_v, mag_l = elias_gamma_codeword(jnp.abs(flat).astype(jnp.uint32))
    tail_v = (mag_v << 1) | (flat < 0).astype(jnp.uint32)  # the magnitude, then the sign bit (mag < 2^31)
    tail_l = mag_l + 1
    # A symbol is one codeword when the run code's significant bits (its value: a 1, then the remainder; the
    # quotient's zeros before it are zero-extension) and the tail fit in 32 bits together: for magnitudes
    # up to 255 with m up to 2^15. Otherwise the run code and the tail are written as two codewords.
    joined = (32 - jax.lax.clz(run_v).astype(jnp.int32)) + tail_l <= 32
    first_v = jnp.where(joined, (run_v << jnp.minimum(tail_l, 31).astype(jnp.uint32)) | tail_v, run_v)
    first_l = jnp.where(nonzero, jnp.where(joined, run_l + tail_l, run_l), 0)
    second_l = jnp.where(nonzero & ~joined, tail_l, 0)
    sym_v = jnp.stack([first_v, tail_v], axis=1).reshape(-1)  # interleaved: one prefix sum over 2 d
    sym_l = jnp.stack([first_l, second_l], axis=1).reshape(-1)
    head_v = jnp.stack([k.astype(jnp.uint32), m.astype(jnp.uint32)])
    head_l = jnp.full((2,), width, jnp.int32)
    if trial_m:
        tv, tl = golomb_codeword(jnp.maximum(jnp.asarray(h, jnp.int32) - 1, 0), trial_m)
        head_v, head_l = jnp.concatenate([tv, head_v]), jnp.concatenate([tl, head_l])
    words, start = write_codewords(head_v, head_l, capacity_words=capacity_words)
    words, end = write_codewords(sym_v, sym_l, capacity_words=capacity_words, bit_offset=start, out=words)
    fits = end <= 32 * (capacity_words - 1)
    return words, as_bits(end), fits


def _trial_length_at(operands, pos):
    """Length of the Golomb codeword (parameter ``m``) of a trial index at ``pos`` (``INVALID_LENGTH``
    where none is valid); ``operands = (view, m)``."""
    view, m = operands
    return golomb_decode_at(view, pos, m)[1]


def _symbol_at(operands, pos):
    """The coordinate symbol at ``pos``: its length (``INVALID_LENGTH`` where the run's Golomb code or the
    magnitude's Elias-gamma code is invalid) and its fields ``(run, magnitude, sign)``;
    ``operands = (view, m)``."""
    view, m = operands
    run, rl, rvalid = golomb_decode_at(view, pos, m)
    mag, ml, mvalid = elias_gamma_decode_at(view, pos + rl)
    sign = read_bits_at(view, pos + rl + ml, 1)
    return jnp.where(rvalid & mvalid, rl + ml + 1, INVALID_LENGTH), (run, mag, sign)


def _symbol_length_at(operands, pos):
    """The length of the coordinate symbol at ``pos`` (:func:`_symbol_at`)."""
    return _symbol_at(operands, pos)[0]


def _chain(length_at, operands, bit_capacity: int, end, max_symbols: int, start, method):
    """The codeword starts from ``start`` to ``end`` (:func:`sidejax.coding.bitstream.codeword_starts`):
    on the CPU (``"walk"``) each length is computed when the walk reaches it
    (:func:`~sidejax.coding.bitstream.walk_symbols`, O(1) a codeword); with ``"jump"`` the lengths at every
    bit position are tabulated first and the chain is found by pointer doubling."""
    if resolve_chain_method(method) == "walk":
        return walk_symbols(
            length_at, operands, end, max_symbols=max_symbols, bit_capacity=bit_capacity, start=start
        )
    table = length_at(operands, jnp.arange(bit_capacity, dtype=jnp.int32))
    return jump_codewords(table, end, max_symbols=max_symbols, start=start)


def _trial_indices(view, end, blocks: int, trial_m: int, bit_capacity: int, method):
    """The ``N`` Golomb-coded trial indices from the start of the stream: ``(h, h_end, ok)``.

    Unary codes (``m_h = 1``: ``Z^2``, ``Z^3``, ``A2``, ``D4``) end at a 1-bit each, so codeword ``j`` ends at
    the ``j``-th 1-bit of the stream and ``h_j`` is the distance between consecutive ones: found for all
    blocks at once (:func:`sidejax.coding.bitstream.set_bit_positions`), with no loop over the codewords.
    Other parameters follow the chain of starts (:func:`_chain`)."""
    if trial_m == 1:
        ones, found = set_bit_positions(view, 0, blocks)
        h = ones - jnp.concatenate([jnp.array([-1], jnp.int32), ones[:-1]])
        h_end = ones[blocks - 1] + 1
        return h, h_end, found & (h_end <= end)
    m_h = jnp.int32(trial_m)
    starts, count, _ = _chain(_trial_length_at, (view, m_h), bit_capacity, end, blocks, 0, method)
    tv, tl, tvalid = golomb_decode_at(view, jnp.clip(starts, 0, bit_capacity - 1), m_h)
    h_end = starts[blocks - 1] + tl[blocks - 1]
    return tv + 1, h_end, (count == blocks) & jnp.all(tvalid) & (h_end <= end)


@functools.partial(jax.jit, static_argnames=("blocks", "n", "trial_m", "method"))
def decode_lattice_stream(words, num_bits, *, blocks: int, n: int, trial_m: int, method: str | None = None):
    """Parses a stream of :func:`encode_lattice_stream` (bit exact).

    The chains of codeword starts are followed first through the ``N`` trial indices, then through the
    coordinate symbols from the header to ``num_bits``. On the CPU the walk reads each codeword where it
    meets it, in O(1) word operations (:func:`sidejax.coding.bitstream.walk_symbols`), so the work is
    proportional to the codewords sent, not to the bits of the static buffer (16 per coordinate by default,
    against 0.2-0.7 sent); with ``method="jump"`` (the accelerators' default) the lengths at every bit
    position are tabulated and the chain found by pointer doubling (same output,
    :func:`sidejax.coding.bitstream.codeword_starts`). Then the values at the starts are read at once.

    Returns:
      ``(h [N], coords [N, n], errors)``: int32 arrays (``h ≡ 1`` when ``trial_m == 0``) and an int32
      ``ERR_*`` bitmask: ``ERR_LENGTH`` (set bits past ``num_bits``), ``ERR_PARSE`` (the fields do not end
      exactly at ``num_bits``, or the symbol count differs from the header's), ``ERR_INPUT`` (a position past
      the end or a magnitude beyond int32). The coordinates are zero on error.
    """
    words = jnp.asarray(words, jnp.uint32)
    dim = blocks * n
    width = dim.bit_length()
    words, ok_len = mask_to_length(words, num_bits)
    end = jnp.asarray(num_bits, jnp.int32)
    view = stream_view(words)
    cap = 32 * words.shape[0]  # bit positions of the buffer
    if trial_m:
        h, h_end, ok_h = _trial_indices(view, end, blocks, trial_m, cap, method)
    else:
        h = jnp.ones((blocks,), jnp.int32)
        h_end = jnp.int32(0)
        ok_h = jnp.asarray(True)
    k = read_bits(words, h_end, width).astype(jnp.int32)
    m = read_bits(words, h_end + width, width).astype(jnp.int32)
    ok_head = (h_end + 2 * width <= end) & (k <= dim) & (m >= 1) & (m <= dim)
    m = jnp.clip(m, 1, dim)
    first = h_end + 2 * width
    if resolve_chain_method(method) == "walk":  # the walk keeps each symbol's fields as it reads them
        _, count, ok_chain, (run, value, sign) = walk_symbol_fields(
            _symbol_at, (view, m), end, max_symbols=dim, bit_capacity=cap, start=first
        )
    else:
        starts, count, ok_chain = _chain(_symbol_length_at, (view, m), cap, end, dim, first, method)
        _, (run, value, sign) = _symbol_at((view, m), jnp.clip(starts, 0, cap - 1))
    live = jnp.arange(dim) < count
    idx, below = _positions_from_gaps(run + 1, live, dim)
    ok_pos = below & jnp.all(jnp.where(live, value <= jnp.uint32(2**31 - 1), True))
    ok_parse = ok_h & ok_head & ok_chain & (count == k)
    signed = jnp.where(sign == 1, -value.astype(jnp.int32), value.astype(jnp.int32))
    good = ok_len & ok_parse & ok_pos
    flat = jnp.zeros((dim,), jnp.int32).at[jnp.where(live & good, idx, dim)].set(signed, mode="drop")
    errors = failed_checks(length=ok_len, parse=ok_parse, input=ok_pos)
    return jnp.where(good, h, 0), flat.reshape(blocks, n), errors


#: value range up to which :func:`_order0_bits` counts by a histogram instead of sorting
_HISTOGRAM_RANGE = 4096


@jax.jit
def _order0_bits(flat: jax.Array) -> jax.Array:
    """``d`` times the empirical entropy (bits) of the values in ``flat [d]``: ``−Σ_v c_v log₂(c_v / d)``
    over the counts ``c_v`` of the distinct values.

    The counts come from a histogram of ``_HISTOGRAM_RANGE`` bins from the smallest value when every value
    fits (one scatter-add: the low-SNR coordinates LRSUQ sends span a few dozen values), and from a sort
    otherwise (a ``lax.cond``; under ``vmap`` both branches run). Both give the same counts."""

    def entropy(counts):
        c = counts.astype(jnp.float32)
        return -jnp.sum(jnp.where(c > 0, c * jnp.log2(jnp.maximum(c, 1.0) / flat.shape[0]), 0.0))

    def histogram(v):
        return entropy(jnp.zeros(_HISTOGRAM_RANGE, jnp.int32).at[v - jnp.min(v)].add(1))

    def by_sort(v):
        s = jnp.sort(v)
        new = jnp.concatenate([jnp.array([True]), s[1:] != s[:-1]])
        seg = prefix_sum(new) - 1
        return entropy(jax.ops.segment_sum(jnp.ones_like(s), seg, num_segments=s.shape[0]))

    span = jnp.max(flat).astype(jnp.uint32) - jnp.min(flat).astype(jnp.uint32)  # exact: wraps mod 2^32
    return jax.lax.cond(span < _HISTOGRAM_RANGE, histogram, by_sort, flat)


def _geom_entropy_bits(p: float) -> float:
    """``H(Geom(p)) = h₂(p)/p`` bits (0 for ``p = 1``)."""
    if p >= 1.0:
        return 0.0
    return (-p * math.log2(p) - (1 - p) * math.log2(1 - p)) / p


def _received(message: Message, capacity: int):
    """The payload fitted to the decoder's static buffer: longer buffers (a stream cut out of a concatenation
    inside jit) are checked for set bits past ``num_bits`` first, then cut; ``ok`` is False when bits are set
    past ``num_bits`` or the stream is longer than any encoder writes."""
    words = jnp.asarray(message.payload, jnp.uint32)
    if words.ndim != 1:
        raise ValueError(f"a message payload must be a 1-D uint32 word array, got shape {words.shape}")
    words, ok = mask_to_length(words, message.num_bits)
    ok = ok & (as_bits(message.num_bits) <= 32 * (capacity - 1))
    return jnp.pad(words[:capacity], (0, capacity - min(words.shape[0], capacity))), ok


def _vector_coder(
    name,
    trial_m,
    acceptance,
    blocks_of,
    quantize,
    reconstruct,
    ideal_trials,
    capacity_bits_per_coordinate,
    method,
):
    """The shared encode/decode of the lattice coders: quantize ``q − center``, write the stream; parse,
    reconstruct, add the center."""
    cap_per = _check_capacity_per_coordinate(capacity_bits_per_coordinate)

    def capacity(dim):
        return lattice_stream_capacity_words(
            blocks_of(dim), blocks_of.n, trial_m, cap_per, acceptance=acceptance if trial_m else None
        )

    def encode(keys, q, p):
        center, level = _center_level(p)
        x = jnp.asarray(q.value, jnp.float32)
        if x.shape != center.shape or x.ndim != 1:
            raise ValueError(f"q and p must be flat vectors of one length, got {x.shape} and {center.shape}")
        d = x.shape[0]
        u = x - center
        h, coords = quantize(keys.shared, u, level)
        words, num_bits, fits = encode_lattice_stream(h, coords, trial_m=trial_m, capacity_words=capacity(d))
        ok = jnp.all(h > 0) & jnp.all(jnp.isfinite(x)) & fits
        if level is not None:
            ok = ok & (level > 0) & jnp.isfinite(level)
        ideal = blocks_of(d) * ideal_trials + _order0_bits(coords.reshape(-1))
        info = LatticeInfo(ok, ideal, jnp.mean(h.astype(jnp.float32)), ~fits)
        return Message(words, num_bits), info

    def decode(shared_key, p, message):
        center, level = _center_level(p)
        d = center.shape[0]
        cap = capacity(d)
        words, ok_size = _received(message, cap)
        h, coords, errors = decode_lattice_stream(
            words, message.num_bits, blocks=blocks_of(d), n=blocks_of.n, trial_m=trial_m, method=method
        )
        errors = errors | failed_checks(length=ok_size)
        x_hat = reconstruct(shared_key, h, coords, d, level)
        out = center + jnp.where(errors == 0, x_hat, 0.0)
        return out, StreamCheck(errors == 0, errors)

    # the dithers (and LRSUQ's trials) come from the shared key; the run-length stream has no fixed length
    return stateless_coder(
        encode, decode, uses_prior=True, name=name, capacity_words=capacity, deterministic=False
    )


class _Blocks:
    """``blocks_of(dim)`` with the lattice dimension as ``.n`` (static)."""

    def __init__(self, lattice: Lattice):
        self.lattice = lattice
        self.n = lattice.dim

    def __call__(self, dim: int) -> int:
        return num_blocks(dim, self.lattice)


def lrsuq_coder(
    lattice: Lattice, noise, *, capacity_bits_per_coordinate: int = 16, method: str | None = None
) -> Coder:
    """CEPAM's quantizer as a coder: LRSUQ of ``q − center`` (Algorithm 2 lines 4-14, the acceptance test
    corrected to include ``+V``, docs/papers/cepam.md#s2-7), sent as trial indices and lattice coordinates.

    The decoded vector is ``center + (q − center) + Z`` with ``Z`` iid ``noise`` per coordinate, independent
    of ``q`` (Proposition 5 / Lemma 11): the quantization error *is* the Gaussian or Laplace mechanism's
    noise. Use :func:`clip_update` around it for Algorithm 2's normalisation to norm ``γ``.

    Args:
      lattice: the lattice (``Z^n`` for the paper, ``n ∈ {1, 2, 3}``; ``A2``, ``D4``, ``E8`` raise the
        acceptance probability, docs/papers/cepam.md#s2-5).
      noise: :class:`~sidejax.coding.lrsuq.GaussianNoise` (any ``n``) or
        :class:`~sidejax.coding.lrsuq.LaplaceNoise` (``n = 1``); its level is used unless ``p`` is a
        :class:`NoisePrior`.
      capacity_bits_per_coordinate: static buffer size per coordinate (see the module docstring).
      method: codeword-chain method of the decoder (``"walk"``, ``"jump"`` or ``None`` for the backend's
        default, :func:`sidejax.coding.bitstream.codeword_starts`).

    Returns:
      A stateless :class:`~sidejax.coding.Coder` (``uses_prior=True``).
    """
    _check_lattice(lattice)
    p = acceptance_probability(lattice, noise)  # validates noise against the lattice
    trial_m = trial_golomb_parameter(p)
    blocks_of = _Blocks(lattice)
    kind = "gauss" if isinstance(noise, GaussianNoise) else "laplace"

    def quantize(key, u, level):
        return lrsuq_quantize(key, u, lattice, noise, level)

    def reconstruct(key, h, coords, d, level):
        return lrsuq_reconstruct(key, h, coords, lattice, noise, d, level)

    return _vector_coder(
        f"lrsuq-{kind}-{lattice.name}",
        trial_m,
        p,
        blocks_of,
        quantize,
        reconstruct,
        _geom_entropy_bits(p),
        capacity_bits_per_coordinate,
        method,
    )


def sdq_coder(
    lattice: Lattice, *, capacity_bits_per_coordinate: int = 16, method: str | None = None
) -> Coder:
    """Subtractive dithered quantization (Definition 1) of ``q − center`` as a coder: the lattice
    coordinates of ``Q(x − V)`` in the run-length stream, no trial indices. The decoded error is
    ``Unif(𝒫)`` (for ``integer_lattice(1, Δ)``: ``Unif[−Δ/2, Δ/2)``), independent of ``q``. The paper's
    FL+SDQ baseline (docs/papers/cepam.md#s3-sdq: the dither scales with the step, unlike [R])."""
    _check_lattice(lattice)
    blocks_of = _Blocks(lattice)

    def quantize(key, u, level):
        del level
        coords = sdq_quantize(key, u, lattice)
        ok = jnp.all(jnp.isfinite(u)) & jnp.all(jnp.abs(u) < 2.0**29 * lattice.scale)
        return jnp.where(ok, 1, 0) * jnp.ones((coords.shape[0],), jnp.int32), coords

    def reconstruct(key, h, coords, d, level):
        del h, level
        return sdq_reconstruct(key, coords, lattice, d)

    return _vector_coder(
        f"sdq-{lattice.name}-{lattice.scale:g}",
        0,
        None,
        blocks_of,
        quantize,
        reconstruct,
        0.0,
        capacity_bits_per_coordinate,
        method,
    )


def _noise_draw(key, noise, shape, level):
    if isinstance(noise, GaussianNoise):
        scale = noise.sigma if level is None else level
        return scale * jax.random.normal(key, shape, jnp.float32)
    scale = noise.b if level is None else level
    return scale * jax.random.laplace(key, shape, jnp.float32)


class NoisyInfo(NamedTuple):
    """:func:`additive_noise_coder`'s encoder info: the inner coder's info and the overall ``valid`` and
    ``ideal_bits`` (the inner's)."""

    inner: object
    valid: jax.Array
    ideal_bits: jax.Array


def additive_noise_coder(noise, inner: Coder | None = None) -> Coder:
    """The classic mechanisms: iid ``noise`` (``N(0, σ²)`` or ``Lap(0, b)`` per coordinate, level from ``p``
    when it is a :class:`NoisePrior`) drawn with the client's *private* key and added to ``q − center``,
    then sent with ``inner`` (default :func:`sidejax.coding.float32_coder`: FL+Gaussian, FL+Laplace;
    :func:`sdq_coder`: FL+Gaussian+SDQ, whose error is the noise plus the quantization error).

    The receiver cannot regenerate the noise: it is the client's own randomness (``draw_key(private, 0)``;
    the inner coder gets the keys unchanged)."""
    if not isinstance(noise, GaussianNoise | LaplaceNoise):
        raise ValueError(f"noise must be a GaussianNoise or a LaplaceNoise, got {type(noise).__name__}")
    inner = float32_coder() if inner is None else inner

    def encode(keys, q, p, state):
        center, level = _center_level(p)
        x = jnp.asarray(q.value, jnp.float32)
        z = _noise_draw(keymod.draw_key(keys.private, 0), noise, x.shape, level)
        message, info = inner.encode(keys, PointMass(x - center + z), _like(p, jnp.zeros_like(center)), state)
        ok = info.valid if level is None else info.valid & (level > 0) & jnp.isfinite(level)
        return message, NoisyInfo(info, ok, info.ideal_bits)

    def decode(shared_key, p, state, message):
        center, _ = _center_level(p)
        y, decoded = inner.decode(shared_key, _like(p, jnp.zeros_like(center)), state, message)
        return center + y, decoded

    kind = "gauss" if isinstance(noise, GaussianNoise) else "laplace"
    return Coder(
        init=inner.init,
        encode=encode,
        decode=decode,
        update=inner.update,
        downlink=inner.downlink,
        receive=inner.receive,
        capacity_words=inner.capacity_words,
        uses_prior=True,
        name=f"{kind}+{inner.name}",
        deterministic=False,  # the private noise
        fixed_bits=inner.fixed_bits,
    )


class ClipInfo(NamedTuple):
    """:func:`clip_update`'s encoder info: the inner coder's info, the update's norm ``||X||``, and the
    overall ``valid`` and ``ideal_bits`` (the inner's, plus 32 for the norm in ``normalise`` mode)."""

    inner: object
    norm: jax.Array
    valid: jax.Array
    ideal_bits: jax.Array


class ClipDecoded(NamedTuple):
    """:func:`clip_update`'s decoder info: the inner coder's, and the whole stream's ``valid``/``errors``."""

    inner: object
    valid: jax.Array
    errors: jax.Array


_MODES = ("normalise", "clip")


def clip_update(coder: Coder, *, gamma: float = 1.0, mode: str = "normalise") -> Coder:
    """Algorithm 2's pre-processing of the update ``X = q − center`` around an inner coder.

    * ``mode="normalise"`` (the paper, Algorithm 2 line 1 and Algorithm 3 line 10): the inner coder sends
      ``X̃ = γX/||X||`` (``0`` when ``X = 0``) and the stream starts with ``||X||`` as float32 (32 bits, the
      scalar the paper calls negligible); the receiver outputs ``center + (||X||/γ)·Ŷ``. The noise of the
      released update then scales with ``||X||`` (data dependent), and the DP claim covers the normalised
      update only (docs/papers/cepam.md#s6-3).
    * ``mode="clip"`` (DP-correct, docs/papers/cepam.md#s6-3 [REC]): the inner coder sends
      ``X̃ = X·min(1, γ/||X||)`` and the receiver outputs ``center + Ŷ``; nothing else is sent, and the
      replace-one sensitivity of an average of ``K`` clipped updates is ``2γ/K``.

    The whole flat vector is one unit (the paper); per-tensor clipping ([R]) is not offered.

    Args:
      coder: the inner coder (``lrsuq_coder``, ``additive_noise_coder``, ...); it sees ``q = X̃`` and ``p``
        centered at zero (a :class:`NoisePrior`'s level kept).
      gamma: the normalisation scale ``γ > 0``.
      mode: ``"normalise"`` or ``"clip"``.
    """
    gamma = check_positive(gamma, "gamma")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    normalise = mode == "normalise"

    def encode(keys, q, p, state):
        center, _ = _center_level(p)
        x = jnp.asarray(q.value, jnp.float32) - center
        norm = jnp.linalg.norm(x)
        safe = jnp.where(norm > 0, norm, 1.0)
        if normalise:
            xt = jnp.where(norm > 0, x * (gamma / safe), 0.0)
        else:
            xt = x * jnp.minimum(1.0, gamma / safe)
        zero = _like(p, jnp.zeros_like(center))
        message, info = coder.encode(keys, PointMass(xt), zero, state)
        ideal = info.ideal_bits
        if normalise:
            message = concat_after_float32(norm[None], message)
            ideal = ideal + 32.0
        return message, ClipInfo(info, norm, info.valid & jnp.isfinite(norm), ideal)

    def decode(shared_key, p, state, message):
        center, _ = _center_level(p)
        zero = _like(p, jnp.zeros_like(center))
        if normalise:
            head, body = split_message(message, (32,))
            norm = decode_float32(head)[0]
            y, decoded = coder.decode(shared_key, zero, state, body)
            errors = decoded.errors | failed_checks(input=jnp.isfinite(norm) & (norm >= 0))
            out = center + (norm / gamma) * y
        else:
            y, decoded = coder.decode(shared_key, zero, state, message)
            errors = decoded.errors
            out = center + y
        return out, ClipDecoded(decoded, errors == 0, errors)

    def update(state, decoded):
        return coder.update(state, decoded.inner)

    # normalise: concat_messages(norm, inner), the norm's word, the inner buffer and one word for the shift
    return wrap_coder(
        coder,
        encode,
        decode,
        update,
        name=f"{mode}({gamma:g})+{coder.name}",
        bits=32 if normalise else 0,
        words=2 if normalise else 0,
        uses_prior=True,
    )
