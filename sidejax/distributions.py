"""Factorized distributions over a flat parameter vector: the ``q`` and ``p`` of channel simulation.

Each distribution is a NamedTuple of arrays whose leading axis is the coordinate axis ``dim`` (so it slices
with ``jax.tree.map(lambda a: a[i:j], dist)``), with

- ``log_prob(x) -> [..., dim]``: elementwise log-probability (``-inf`` outside the support);
- ``icdf(u) -> [..., dim]``: the inverse-CDF transform of uniforms in (0, 1). Candidates of the importance
  coder are ``p.icdf(u)`` for counter-based uniforms ``u``, which lets the decoder regenerate only the
  selected candidates;
- ``sample(key, sample_shape=())``;
- ``kl_nats(other)`` / ``kl_bits(other)``: elementwise :math:`D_{KL}(\\text{self} \\| \\text{other})`.

**Validation.** Constructing a distribution from concrete values (outside ``jit``) checks them and raises
``ValueError`` naming the argument: probabilities must lie in [0, 1] (NaN rejected; Ternary rows must sum
to 1), Gaussian ``loc`` must be finite and ``scale`` finite and > 0. Traced values cannot be checked when
the object is built; ``is_valid()`` returns the same check as a boolean scalar for use inside jit (the KLMS
coder reports it in its info flags). Rebuilding a distribution from its leaves (pytree unflattening, e.g.
``jax.tree.map``) does not re-check.

Supports and KLMS use (docs/papers/klms.md#s4-0): :class:`Bernoulli` on {0, 1} (FedPM masks),
:class:`Ternary` on {-1, 0, +1} (QSGD symbols, s = 1), :class:`Sign` on {-1, +1} (stochastic SignSGD) and
:class:`DiagGaussian` on the reals (SGLD, the App. F toy). All KLs use ``xlogy`` so that zero-probability
outcomes contribute exactly 0 and a KL is infinite only where ``self`` puts mass where ``other`` has none.
"""

from __future__ import annotations

from typing import NamedTuple, Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtri, xlogy

from sidejax.bits import LN2
from sidejax.utils import is_concrete

__all__ = [
    "Bernoulli",
    "Ternary",
    "Sign",
    "DiagGaussian",
    "PointMass",
    "StochasticLevels",
    "uniform_open",
    "check_probabilities",
    "check_positive",
    "check_finite",
    "check_dims",
    "is_valid",
    "dist_dim",
]

TERNARY_SYMBOLS = (-1.0, 0.0, 1.0)


def uniform_open(key, shape) -> jax.Array:
    """Uniforms in the open interval (0, 1) (never exactly 0 or 1, so ``ndtri`` stays finite)."""
    bits = jax.random.bits(key, shape, jnp.uint32)
    return bits_to_open_uniform(bits)


def bits_to_open_uniform(bits: jax.Array) -> jax.Array:
    """Maps uint32 words to float32 uniforms ``(floor(bits / 2^9) + 0.5) / 2^23`` in (0, 1).

    With 23 bits every value, ``2^-24`` to ``1 - 2^-24``, is exactly representable in float32; with 24 bits
    the largest, ``1 - 2^-25``, would round to 1.0 and an inverse CDF such as ``ndtri`` would return inf.
    """
    return ((bits >> 9).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-23)


def dist_dim(dist) -> int:
    """The number of coordinates of a factorized distribution (the leading axis of its arrays)."""
    leaf = jax.tree.leaves(dist)[0]
    if jnp.ndim(leaf) < 1:
        raise ValueError(f"{type(dist).__name__} needs a leading coordinate axis, got a scalar")
    return int(jnp.shape(leaf)[0])


def is_valid(dist) -> jax.Array:
    """bool scalar: ``dist.is_valid()`` (usable inside jit), or True for a distribution type without the
    method (e.g. a user's own pytree)."""
    check = getattr(dist, "is_valid", None)
    return jnp.asarray(True) if check is None else check()


def check_dims(dim: int, built_for: str, fix: str, **dists) -> None:
    """Raises ``ValueError`` naming the argument and both dimensions if a distribution in ``dists``
    (``name=dist``) does not have ``dim`` coordinates: "``name`` has ``n`` coordinates but ``built_for``
    dim=``dim``: ``fix``" (``fix`` may use ``{got}``, the distribution's dimension)."""
    for name, d in dists.items():
        got = dist_dim(d)
        if got != dim:
            raise ValueError(f"{name} has {got} coordinates but {built_for} dim={dim}: {fix.format(got=got)}")


def _probs_ok(probs) -> jax.Array:
    return jnp.all((probs >= 0) & (probs <= 1))  # False for NaN


def _register(cls):
    """Pytree registration that rebuilds instances without re-validating (leaves may be tracers or
    placeholders); the field names are the key paths, as for a plain NamedTuple."""
    fields = cls._fields

    def flatten_with_keys(d):
        return tuple((jax.tree_util.GetAttrKey(f), getattr(d, f)) for f in fields), None

    def unflatten(_, children):
        return tuple.__new__(cls, tuple(children))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, lambda d: (tuple(d), None))
    return cls


def check_probabilities(x, name: str, *, axis_sums_to_one: int | None = None) -> None:
    """Raises ``ValueError`` naming ``name`` if a concrete ``x`` has entries outside [0, 1] or NaN.

    Traced values (inside ``jit``) are not checked; validate at the public boundary before jitting.
    """
    if not is_concrete(x):
        return
    a = np.asarray(x)
    if not np.all((a >= 0) & (a <= 1)):
        bad = a[~((a >= 0) & (a <= 1))].ravel()[:3]
        raise ValueError(f"{name} must hold probabilities in [0, 1]; found e.g. {bad.tolist()}")
    if axis_sums_to_one is not None and not np.allclose(a.sum(axis_sums_to_one), 1.0, atol=1e-5):
        raise ValueError(f"{name} must sum to 1 along axis {axis_sums_to_one}")


def check_positive(x, name: str) -> None:
    """Raises ``ValueError`` naming ``name`` if a concrete ``x`` has entries <= 0, inf or NaN."""
    if is_concrete(x):
        a = np.asarray(x, dtype=np.float64)
        if not np.all((a > 0) & np.isfinite(a)):
            bad = a[~((a > 0) & np.isfinite(a))].ravel()[:3]
            raise ValueError(f"{name} must be finite and > 0 everywhere; found e.g. {bad.tolist()}")


def check_finite(x, name: str) -> None:
    """Raises ``ValueError`` naming ``name`` if a concrete ``x`` has NaN or inf entries."""
    if is_concrete(x):
        a = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} must be finite; found e.g. {a[~np.isfinite(a)].ravel()[:3].tolist()}")


class _Factorized:
    """What every factorized law derives from its own ``icdf`` and ``kl_nats``: ``sample`` draws the
    inverse CDF of open uniforms (:func:`uniform_open`) over ``_coords_shape`` (:class:`StochasticLevels`,
    which has no inverse CDF, overrides it), ``kl_bits`` is ``kl_nats`` in bits."""

    __slots__ = ()

    def _coords_shape(self) -> tuple[int, ...]:
        """The shape of one sample: the leading field's shape."""
        return self[0].shape

    def sample(self, key, sample_shape=()) -> jax.Array:
        return self.icdf(uniform_open(key, tuple(sample_shape) + self._coords_shape()))

    def kl_bits(self, other) -> jax.Array:
        return self.kl_nats(other) / LN2


class _ProbabilityLaw(_Factorized):
    """A law given by one array ``probs`` of probabilities: validated when built from concrete values
    (:func:`check_probabilities`, the message naming ``"<Class> probs"``), rows summing to 1 along
    ``_sums_to_one`` unless it is ``None``."""

    __slots__ = ()
    _sums_to_one: int | None = None

    def __new__(cls, probs):
        check_probabilities(probs, f"{cls.__name__} probs", axis_sums_to_one=cls._sums_to_one)
        return super().__new__(cls, probs)

    @classmethod
    def create(cls, probs) -> Self:
        """Validating constructor that also converts to float32."""
        check_probabilities(probs, f"{cls.__name__} probs", axis_sums_to_one=cls._sums_to_one)
        return cls(jnp.asarray(probs, jnp.float32))

    def is_valid(self) -> jax.Array:
        """bool scalar: every probability in [0, 1] (no NaN); usable inside jit."""
        return _probs_ok(self.probs)


class _BernoulliFields(NamedTuple):
    probs: jax.Array


@_register
class Bernoulli(_ProbabilityLaw, _BernoulliFields):
    """Independent Bernoulli coordinates on {0, 1} with ``probs = P(X = 1)``, shape ``[dim]``.

    ``Bernoulli(probs)`` with concrete probabilities outside [0, 1] or NaN raises ``ValueError``.
    """

    __slots__ = ()

    def log_prob(self, x: jax.Array) -> jax.Array:
        return jnp.where(x > 0.5, jnp.log(self.probs), jnp.log1p(-self.probs))

    def icdf(self, u: jax.Array) -> jax.Array:
        return (u < self.probs).astype(jnp.float32)

    def mean(self) -> jax.Array:
        return self.probs

    def kl_nats(self, other: Bernoulli) -> jax.Array:
        q, p = self.probs, other.probs
        return xlogy(q, q) - xlogy(q, p) + xlogy(1 - q, 1 - q) - xlogy(1 - q, 1 - p)


class _TernaryFields(NamedTuple):
    probs: jax.Array


@_register
class Ternary(_ProbabilityLaw, _TernaryFields):
    """Independent coordinates on {-1, 0, +1}; ``probs[..., i]`` is the probability of symbol i-1.

    Shape ``[dim, 3]``: QSGD's s = 1 symbol law (docs/papers/klms.md#s4-3). Concrete rows must be
    probabilities summing to 1 (to 1e-5), else ``ValueError``.
    """

    __slots__ = ()
    _sums_to_one = -1

    def _coords_shape(self) -> tuple[int, ...]:
        return self.probs.shape[:-1]

    def is_valid(self) -> jax.Array:
        """bool scalar: entries in [0, 1] and rows summing to 1 (to 1e-5); usable inside jit."""
        return _probs_ok(self.probs) & jnp.all(jnp.abs(jnp.sum(self.probs, axis=-1) - 1.0) <= 1e-5)

    def _index(self, x: jax.Array) -> jax.Array:
        return jnp.clip(jnp.round(x).astype(jnp.int32) + 1, 0, 2)

    def log_prob(self, x: jax.Array) -> jax.Array:
        logp = jnp.log(self.probs)  # [dim, 3]
        idx = self._index(x)
        return jnp.take_along_axis(jnp.broadcast_to(logp, idx.shape + (3,)), idx[..., None], -1)[..., 0]

    def icdf(self, u: jax.Array) -> jax.Array:
        c0 = self.probs[..., 0]
        c1 = c0 + self.probs[..., 1]
        return jnp.where(u < c0, -1.0, jnp.where(u < c1, 0.0, 1.0)).astype(jnp.float32)

    def mean(self) -> jax.Array:
        return self.probs[..., 2] - self.probs[..., 0]

    def kl_nats(self, other: Ternary) -> jax.Array:
        q, p = self.probs, other.probs
        return jnp.sum(xlogy(q, q) - xlogy(q, p), axis=-1)


class _SignFields(NamedTuple):
    probs: jax.Array


@_register
class Sign(_ProbabilityLaw, _SignFields):
    """Independent coordinates on {-1, +1} with ``probs = P(X = +1)``, shape ``[dim]`` (concrete values
    outside [0, 1] or NaN raise ``ValueError``)."""

    __slots__ = ()

    def log_prob(self, x: jax.Array) -> jax.Array:
        return jnp.where(x > 0, jnp.log(self.probs), jnp.log1p(-self.probs))

    def icdf(self, u: jax.Array) -> jax.Array:
        return jnp.where(u < self.probs, 1.0, -1.0).astype(jnp.float32)

    def mean(self) -> jax.Array:
        return 2.0 * self.probs - 1.0

    def kl_nats(self, other: Sign) -> jax.Array:
        return Bernoulli(self.probs).kl_nats(Bernoulli(other.probs))


class _DiagGaussianFields(NamedTuple):
    loc: jax.Array
    scale: jax.Array


@_register
class DiagGaussian(_Factorized, _DiagGaussianFields):
    """Independent Gaussians ``N(loc, scale^2)``, shapes ``[dim]`` (concrete ``loc`` must be finite and
    ``scale`` finite and > 0, else ``ValueError``)."""

    __slots__ = ()

    def __new__(cls, loc, scale):
        check_finite(loc, "DiagGaussian loc")
        check_positive(scale, "DiagGaussian scale")
        return super().__new__(cls, loc, scale)

    @classmethod
    def create(cls, loc, scale) -> DiagGaussian:
        loc = jnp.asarray(loc, jnp.float32)
        return cls(loc, jnp.broadcast_to(jnp.asarray(scale, jnp.float32), loc.shape))

    def is_valid(self) -> jax.Array:
        """bool scalar: ``loc`` finite and ``scale`` finite and > 0; usable inside jit."""
        return jnp.all(jnp.isfinite(self.loc)) & jnp.all((self.scale > 0) & jnp.isfinite(self.scale))

    def log_prob(self, x: jax.Array) -> jax.Array:
        z = (x - self.loc) / self.scale
        return -0.5 * z * z - jnp.log(self.scale) - 0.5 * jnp.log(2 * jnp.pi)

    def icdf(self, u: jax.Array) -> jax.Array:
        return self.loc + self.scale * ndtri(u)

    def mean(self) -> jax.Array:
        return self.loc

    def kl_nats(self, other: DiagGaussian) -> jax.Array:
        var_ratio = (self.scale / other.scale) ** 2
        diff = (self.loc - other.loc) / other.scale
        return 0.5 * (var_ratio + diff * diff - 1.0 - jnp.log(var_ratio))


class _FiniteArray:
    """A law given by one real array (its only field) that must be finite: checked when built from
    concrete values (:func:`check_finite`, the message naming ``"<Class> <field>"``) and by ``is_valid``."""

    __slots__ = ()

    def __new__(cls, value):
        check_finite(value, f"{cls.__name__} {cls._fields[0]}")
        return super().__new__(cls, value)

    def is_valid(self) -> jax.Array:
        """bool scalar: the array is finite; usable inside jit."""
        return jnp.all(jnp.isfinite(self[0]))


class _PointMassFields(NamedTuple):
    value: jax.Array


@_register
class PointMass(_FiniteArray, _PointMassFields):
    """The point mass at ``value`` (shape ``[dim]``): a deterministic message such as FedAvg's parameters,
    sent by the float32 coder. ``sample`` ignores its key. Concrete ``value`` must be finite."""

    __slots__ = ()

    def log_prob(self, x: jax.Array) -> jax.Array:
        return jnp.where(x == self.value, 0.0, -jnp.inf)

    def sample(self, key, sample_shape=()) -> jax.Array:
        del key
        return jnp.broadcast_to(self.value, tuple(sample_shape) + self.value.shape)

    def mean(self) -> jax.Array:
        return self.value


class _StochasticLevelsFields(NamedTuple):
    scaled: jax.Array


@_register
class StochasticLevels(_FiniteArray, _Factorized, _StochasticLevelsFields):
    """QSGD's unbiased stochastic rounding (Alistarh et al. 2017, eq. 1) in units of ``norm / s``.

    ``scaled`` :math:`= s\\, v_i / n_{l(i)}` (shape ``[dim]``, :math:`|scaled| \\le s`); a sample is the
    signed level :math:`\\mathrm{sign}(v_i)(\\lfloor r_i \\rfloor + \\mathrm{Bern}(r_i - \\lfloor r_i
    \\rfloor))`, :math:`r_i = |scaled_i|`, as a float (an integer in ``[-s, s]``). The rounding uniforms are
    ``jax.random.uniform(key, [dim])``. Concrete ``scaled`` must be finite.
    """

    __slots__ = ()

    def as_ternary(self) -> Ternary:
        """For ``s = 1`` (:math:`|scaled| \\le 1`), the same law as a :class:`Ternary` over {-1, 0, +1}:
        :math:`(\\max(-a, 0), 1 - |a|, \\max(a, 0))` with ``a = clip(scaled, -1, 1)`` (QSGD-KLMS's eq. 5)."""
        a = jnp.clip(self.scaled, -1.0, 1.0)
        probs = jnp.stack([jnp.maximum(-a, 0.0), 1.0 - jnp.abs(a), jnp.maximum(a, 0.0)], axis=-1)
        return tuple.__new__(Ternary, (probs,))

    def log_prob(self, x: jax.Array) -> jax.Array:
        """Log-probability of symbols in {-1, 0, +1} (``s = 1`` only; see :meth:`as_ternary`)."""
        return self.as_ternary().log_prob(x)

    def kl_nats(self, other: Ternary) -> jax.Array:
        """:math:`D_{KL}` against a :class:`Ternary` (``s = 1`` only)."""
        return self.as_ternary().kl_nats(other)

    def sample(self, key, sample_shape=()) -> jax.Array:
        r = jnp.abs(self.scaled)
        low = jnp.floor(r)
        up = jax.random.uniform(key, tuple(sample_shape) + r.shape) < (r - low)
        return jnp.sign(self.scaled) * (low + up)

    def mean(self) -> jax.Array:
        return self.scaled
