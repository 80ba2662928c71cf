r"""Lattices with fast nearest-point search: scaled ``Z^n``, hexagonal ``A2``, ``D4`` and ``E8``.

A lattice is ``Λ = s·G Z^n = {s·G j : j ∈ Z^n}`` with a generator ``G ∈ R^{n×n}`` whose **columns** are the
basis vectors (the convention of docs/papers/cepam.md#s2-0, ``Λ = G Z^n``) and a scale ``s > 0``. Its basic
Voronoi cell ``𝒱 = {x : ||x|| ≤ ||x − λ|| ∀λ ∈ Λ}`` has volume ``μ(𝒱) = |det(sG)| = s^n |det G|``, the
covering radius ``R = max_{x ∈ 𝒱} ||x||`` and the packing radius ``ρ = min_{λ ≠ 0} ||λ|| / 2``.

:meth:`Lattice.nearest` is the lattice quantizer ``Q(x) = argmin_{λ ∈ Λ} ||x − λ||``
(docs/papers/cepam.md#s2-1), batched over leading axes, pure ``jax.numpy`` (no loops over points), so it runs
under ``jit`` and ``vmap``. It returns the point and its integer coordinates ``j`` (``point = sG j``). The
decoders are Conway & Sloane's (SPLAG ch. 20; "Fast quantizing and decoding algorithms for lattice
quantizers", IEEE T-IT 1982):

* ``Z^n``: ``Q(x) = floor(x + 1/2)`` componentwise, so the cell is ``[−1/2, 1/2)^n`` (ties go up), as
  docs/papers/cepam.md#s2-1 recommends.
* ``D_n = {p ∈ Z^n : Σ p_i even}``: ``f(x)`` = ``Z^n``-rounding; ``g(x)`` = ``f(x)`` with the coordinate of
  largest ``|x_i − f(x)_i|`` rounded the other way; ``Q(x)`` is whichever of ``f, g`` has an even sum.
* ``E8 = D8 ∪ (D8 + ½·1)``: decode ``x`` in ``D8`` and ``x − ½·1`` in ``D8`` (then add ``½·1`` back) and take
  the nearer of the two candidates (``D8`` on ties).
* ``A2`` (minimal norm 1, basis ``(1, 0)``, ``(1/2, √3/2)``): the two-coset rectangular decomposition
  ``A2 = R ∪ (R + (1/2, √3/2))`` with the rectangular lattice ``R = Z × √3 Z``; round in each coset
  componentwise (nearest point of a rectangular lattice) and take the nearer (``R`` on ties).

Equidistant candidates (points on a cell boundary) are resolved deterministically as stated; any of them is
a nearest point. Normalisations (SPLAG ch. 4, Table 1.2 / 2.3), all at scale ``s = 1``:

=====  ==========  ==================  ==============  ===========================
name   ``μ(𝒱)``    covering radius R   packing ρ       normalized second moment
=====  ==========  ==================  ==============  ===========================
Z^n    1           √n / 2              1/2             1/12 ≈ 0.0833333
A2     √3/2        1/√3                1/2             5/(36√3) ≈ 0.0801875
D4     2           1                   1/√2            ≈ 0.0766032
E8     1           1                   1/√2            929/12960 ≈ 0.0716821
=====  ==========  ==================  ==============  ===========================

Scaling by ``s`` multiplies the generator, the radii and the points by ``s`` and the volume by ``s^n``; the
integer coordinates of ``Q_s(x)`` equal those of ``Q_1(x / s)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.utils import check_positive

__all__ = ["Lattice", "integer_lattice", "hexagonal", "d4", "e8"]

_SQRT3 = math.sqrt(3.0)


def _dn_basis(n: int) -> np.ndarray:
    """Columns ``2e_1, e_2 − e_1, …, e_n − e_{n−1}`` (|det| = 2): a basis of ``D_n``."""
    b = np.zeros((n, n))
    b[0, 0] = 2.0
    for i in range(1, n):
        b[i, i], b[i - 1, i] = 1.0, -1.0
    return b


def _e8_basis() -> np.ndarray:
    """Conway & Sloane's E8 generator (SPLAG ch. 4 eq. (98)) as columns: ``2e_1``, ``e_i − e_{i−1}``
    (``i = 2..7``) and ``½·1`` (|det| = 1)."""
    b = np.zeros((8, 8))
    b[:, :7] = _dn_basis(8)[:, :7]
    b[:, 7] = 0.5
    return b


_HEX_BASIS = np.array([[1.0, 0.5], [0.0, _SQRT3 / 2.0]])

# kind -> (unscaled generator (columns), unscaled covering radius, unscaled packing radius)
_GEOMETRY = {
    "A2": (lambda n: _HEX_BASIS, lambda n: 1.0 / _SQRT3, lambda n: 0.5),
    "D4": (lambda n: _dn_basis(4), lambda n: 1.0, lambda n: 1.0 / math.sqrt(2.0)),
    "E8": (lambda n: _e8_basis(), lambda n: 1.0, lambda n: 1.0 / math.sqrt(2.0)),
    "Z": (lambda n: np.eye(n), lambda n: math.sqrt(n) / 2.0, lambda n: 0.5),
}


def _round_half_up(y: jax.Array) -> jax.Array:
    """``floor(y + 1/2)`` as int32 (the ``Z^n`` quantizer with cell ``[−1/2, 1/2)^n``)."""
    return jnp.floor(y + 0.5).astype(jnp.int32)


def _decode_dn(y: jax.Array) -> jax.Array:
    """Nearest point of ``D_n = {p ∈ Z^n : Σp even}`` to ``y [..., n]`` (Conway–Sloane), as int32 ``p``."""
    f = _round_half_up(y)
    delta = y - f.astype(y.dtype)  # in [-1/2, 1/2)
    worst = jnp.argmax(jnp.abs(delta), axis=-1)
    step = jnp.where(jnp.take_along_axis(delta, worst[..., None], axis=-1) >= 0, 1, -1).astype(jnp.int32)
    g = f + step * jax.nn.one_hot(worst, y.shape[-1], dtype=jnp.int32)
    even = (jnp.sum(f, axis=-1, keepdims=True) % 2) == 0
    return jnp.where(even, f, g)


def _dn_coords(p: jax.Array) -> jax.Array:
    """Coordinates ``c`` of ``p ∈ D_m`` in :func:`_dn_basis`: ``c_k = Σ_{j≥k} p_j`` (``k ≥ 2``) and
    ``c_1 = (Σ_j p_j) / 2`` (exact integer arithmetic; ``Σ p`` is even)."""
    tail = jnp.cumsum(p[..., ::-1], axis=-1)[..., ::-1]
    return tail.at[..., 0].set(tail[..., 0] // 2)


def _coords_z(y: jax.Array) -> jax.Array:
    return _round_half_up(y)


def _coords_d4(y: jax.Array) -> jax.Array:
    return _dn_coords(_decode_dn(y))


def _coords_e8(y: jax.Array) -> jax.Array:
    p0 = _decode_dn(y)  # coset D8
    q1 = _decode_dn(y - 0.5)  # coset D8 + ½·1 is q1 + ½
    d0 = jnp.sum(jnp.square(y - p0.astype(y.dtype)), axis=-1, keepdims=True)
    d1 = jnp.sum(jnp.square(y - 0.5 - q1.astype(y.dtype)), axis=-1, keepdims=True)
    use1 = d1 < d0
    t = jnp.where(use1, 2 * q1 + 1, 2 * p0)  # t = 2p, an integer vector
    c8 = t[..., 7:]  # p = Σ c_i b_i has p_8 = c_8 / 2
    q = (t[..., :7] - c8) // 2  # p − (c_8/2)·1, restricted to coords 1..7 (coord 8 is 0); Σq even
    return jnp.concatenate([_dn_coords(q), c8], axis=-1)


def _coords_a2(y: jax.Array) -> jax.Array:
    u, w = y[..., 0], y[..., 1]
    v = w / _SQRT3
    a0, b0 = _round_half_up(u), _round_half_up(v)  # R = Z × √3Z: point (a0, √3 b0)
    a1, b1 = jnp.floor(u).astype(jnp.int32), jnp.floor(v).astype(jnp.int32)  # R + (½, √3/2)
    dt = y.dtype
    d0 = jnp.square(u - a0.astype(dt)) + jnp.square(w - _SQRT3 * b0.astype(dt))
    d1 = jnp.square(u - a1.astype(dt) - 0.5) + jnp.square(w - _SQRT3 * (b1.astype(dt) + 0.5))
    use1 = d1 < d0
    # (a, √3 b) = (a − b)(1, 0) + 2b (½, √3/2);  (a + ½, √3(b + ½)) = (a − b)(1, 0) + (2b + 1)(½, √3/2)
    c1 = jnp.where(use1, a1 - b1, a0 - b0)
    c2 = jnp.where(use1, 2 * b1 + 1, 2 * b0)
    return jnp.stack([c1, c2], axis=-1)


_DECODERS = {"Z": _coords_z, "A2": _coords_a2, "D4": _coords_d4, "E8": _coords_e8}


@dataclasses.dataclass(frozen=True)
class Lattice:
    """A scaled lattice ``Λ = s·G Z^n`` with a fast nearest-point search; hashable, so it can be a static
    argument of ``jax.jit`` (the geometry is derived from ``(kind, dim, scale)``).

    Build it with :func:`integer_lattice`, :func:`hexagonal`, :func:`d4` or :func:`e8`.

    Attributes:
        kind: ``"Z"``, ``"A2"``, ``"D4"`` or ``"E8"``.
        dim: the dimension ``n``.
        scale: ``s > 0``.
    """

    kind: str
    dim: int
    scale: float = 1.0

    def __post_init__(self):
        fixed = {"A2": 2, "D4": 4, "E8": 8}
        if self.kind not in _GEOMETRY:
            raise ValueError(f"kind must be one of {sorted(_GEOMETRY)}, got {self.kind!r}")
        if self.kind in fixed and self.dim != fixed[self.kind]:
            raise ValueError(f"dim must be {fixed[self.kind]} for kind {self.kind!r}, got {self.dim!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, numbers.Integral) or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim!r}")
        object.__setattr__(self, "scale", check_positive(self.scale, "scale"))

    @property
    def name(self) -> str:
        """``"Z^n"``, ``"A2"``, ``"D4"`` or ``"E8"``, with ``"*s"`` appended when ``s ≠ 1``."""
        base = f"Z^{self.dim}" if self.kind == "Z" else self.kind
        return base if self.scale == 1.0 else f"{base}*{self.scale:g}"

    @property
    def generator(self) -> np.ndarray:
        """``s·G`` (float64 ``[n, n]``), basis vectors in the **columns**: ``point = generator @ coords``."""
        return self.scale * _GEOMETRY[self.kind][0](self.dim)

    @property
    def volume(self) -> float:
        """Basic (Voronoi) cell volume ``μ(𝒱) = |det(sG)|``."""
        return float(abs(np.linalg.det(self.generator)))

    @property
    def covering_radius(self) -> float:
        """``R = max_{x ∈ 𝒱} ||x||`` (distance from a deep hole to the lattice)."""
        return self.scale * _GEOMETRY[self.kind][1](self.dim)

    @property
    def packing_radius(self) -> float:
        """``ρ = min_{λ ≠ 0} ||λ|| / 2`` (the inradius of the Voronoi cell)."""
        return self.scale * _GEOMETRY[self.kind][2](self.dim)

    def generate(self, v: jax.Array) -> jax.Array:
        """``(sG) v`` over the last axis of a float array ``v [..., n]`` (a point from its coordinates, or a
        point of the fundamental parallelepiped from ``v ∈ [0, 1)^n``), at ``HIGHEST`` precision. On ``Z^n``
        (``G = I``) it is ``s·v``: the same numbers as the product, whose other terms are exact zeros,
        without a matrix product per block."""
        if self.kind == "Z":
            return jnp.asarray(self.scale, v.dtype) * v
        gen = jnp.asarray(self.generator, v.dtype)
        return jnp.einsum("ij,...j->...i", gen, v, precision=jax.lax.Precision.HIGHEST)

    def nearest(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Nearest lattice point ``Q(x) = argmin_{λ ∈ Λ} ||x − λ||``, batched over leading axes.

        The integer coordinates are decoded from ``x / s`` (module docstring), then
        ``point = (sG) coords`` (a float product at ``HIGHEST`` precision, so ``point`` is exactly
        ``generator @ coords`` up to the float rounding of that product; exact for ``Z^n``, ``D4``, ``E8``
        with a power-of-two scale and moderate coordinates).

        Args:
            x: ``[..., n]`` real array (integer input is promoted to the default float dtype).

        Returns:
            ``(point, coords)``: ``point [..., n]`` in ``x``'s float dtype and ``coords`` int32 ``[..., n]``.

        Raises:
            ValueError: if ``x``'s trailing dimension is not ``n``.
        """
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[-1] != self.dim:
            raise ValueError(
                f"x: trailing dimension must be the lattice dimension {self.dim}, got shape {x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.result_type(float))
        return _nearest(self, x)


@functools.partial(jax.jit, static_argnums=0)
def _nearest(lattice: Lattice, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:meth:`Lattice.nearest` after validation, compiled once per (lattice, shape, dtype) so eager calls
    do not dispatch op by op (a jit inside an outer ``jit``/``vmap`` is inlined)."""
    coords = _DECODERS[lattice.kind](x / jnp.asarray(lattice.scale, x.dtype))
    return lattice.generate(coords.astype(x.dtype)), coords


def integer_lattice(n: int, scale: float = 1.0) -> Lattice:
    """The scaled integer lattice ``s Z^n``: ``Q(x) = s·floor(x/s + 1/2)``, cell ``s[−1/2, 1/2)^n``,
    volume ``s^n``, covering radius ``s√n/2``, packing radius ``s/2``.

    Raises:
        ValueError: if ``n`` is not a positive integer or ``scale`` is not finite and ``> 0``.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return Lattice("Z", int(n), check_positive(scale, "scale"))


def hexagonal(scale: float = 1.0) -> Lattice:
    """The hexagonal lattice ``s·A2`` with minimal norm ``s`` (basis ``s(1, 0)``, ``s(1/2, √3/2)``): volume
    ``s²√3/2``, covering radius ``s/√3``, packing radius ``s/2``.

    Raises:
        ValueError: if ``scale`` is not finite and ``> 0``.
    """
    return Lattice("A2", 2, check_positive(scale, "scale"))


def d4(scale: float = 1.0) -> Lattice:
    """The checkerboard lattice ``s·D4 = s{p ∈ Z^4 : Σp even}``: volume ``2s⁴``, covering radius ``s``,
    packing radius ``s/√2``.

    Raises:
        ValueError: if ``scale`` is not finite and ``> 0``.
    """
    return Lattice("D4", 4, check_positive(scale, "scale"))


def e8(scale: float = 1.0) -> Lattice:
    """The Gosset lattice ``s·E8 = s(D8 ∪ (D8 + ½·1))`` in standard coordinates: volume ``s⁸``, covering
    radius ``s``, packing radius ``s/√2``.

    Raises:
        ValueError: if ``scale`` is not finite and ``> 0``.
    """
    return Lattice("E8", 8, check_positive(scale, "scale"))
