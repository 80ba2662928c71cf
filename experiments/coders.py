"""The ``[coder]`` table: one typed config per coder of :mod:`sidejax.coding` (``name`` picks it).

- ``klms`` (:class:`KLMSCoderConfig`): KLMS channel simulation, :func:`sidejax.coding.klms_coder`;
- ``float32``: the uncompressed value, 32 bits per coordinate (:func:`sidejax.coding.float32_coder`);
- ``signs``: one bit per sign (:func:`sidejax.coding.fixed_width_coder` over ``(-1, 1)``);
- ``elias``: QSGD's Elias code of the levels (:func:`sidejax.coding.elias_coder`, ``s`` from the method);
- ``mask``: a Golomb-coded binary mask (:func:`sidejax.coding.mask_coder`);
- ``klms_avg``: KLMS with BICompFL's Adaptive-Avg allocation (:func:`sidejax.coding.klms_avg_coder`);
- ``lrsuq``: CEPAM's layered rejection-sampled universal quantizer, its error exactly Gaussian or Laplace
  noise, with Algorithm 2's normalisation (:func:`sidejax.coding.lrsuq_coder` in
  :func:`sidejax.coding.clip_update`);
- ``noise``: the classic Gaussian / Laplace mechanism (private noise after the normalisation), sent as float32
  or, with ``sdq_step > 0``, SDQ-quantized (:func:`sidejax.coding.additive_noise_coder`);
- ``sdq``: subtractive dithered quantization of the update (:func:`sidejax.coding.sdq_coder`);
- ``scaled_sign``: the deterministic scaled sign, a float32 scale and one bit per coordinate
  (:func:`sidejax.coding.scaled_sign_coder`), the error-feedback baselines' compressor;
- ``topk``: the deterministic TopK, K float32 values and their positions in ceil(log2 d) bits each
  (:func:`sidejax.coding.topk_coder`), M3's uplink compressor.

Which coders a method accepts is the method's choice (:attr:`experiments.methods.MethodConfig.coders`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from experiments.sections import Section, by_name, choice, fills
from sidejax.coding import (
    Coder,
    GaussianNoise,
    KLMSAvgConfig,
    KLMSConfig,
    LaplaceNoise,
    additive_noise_coder,
    clip_update,
    elias_coder,
    fixed_width_coder,
    float32_coder,
    klms_avg_coder,
    klms_coder,
    lrsuq_coder,
    mask_coder,
    pseudocoreset_coder,
    scaled_sign_coder,
    sdq_coder,
    topk_coder,
    with_crc,
)
from sidejax.coding.klms import TRIGGERS
from sidejax.lattices import d4, e8, hexagonal, integer_lattice

if TYPE_CHECKING:
    from experiments.methods import MethodConfig

__all__ = [
    "CoderConfig",
    "KLMSCoderConfig",
    "Float32CoderConfig",
    "SignsCoderConfig",
    "EliasCoderConfig",
    "MaskCoderConfig",
    "KLMSAvgCoderConfig",
    "ScaledSignCoderConfig",
    "MechanismConfig",
    "LRSUQCoderConfig",
    "NoiseCoderConfig",
    "SDQCoderConfig",
    "TopKCoderConfig",
    "LATTICES",
    "CODERS",
]


#: the library coder settings the experiments leave at their defaults (memory and bucketing: no effect on the
#: bits), or set from elsewhere (``crc32``: :attr:`CoderConfig.crc32`)
_ENGINE_FIELDS = (
    "max_blocks",
    "memory_budget_bytes",
    "crc32",
    "bucketed",
    "bucket_update_rounds",
    "initial_update",
    "chunk_size",
)


@dataclass(frozen=True)
class CoderConfig(Section):
    """Base of the coder configs: :attr:`name` is the ``[coder]`` table's ``name``.

    Attributes:
      crc32: end every message with a CRC-32 of (the shared key, the prior when the coder uses one, the
        stream), +32 bits counted: a flipped bit, a wrong key or a drifted prior is reported as an invalid
        stream instead of decoding to a plausible wrong value (sidejax.coding.with_crc; KLMS and KLMS-Avg
        put the same check inside their own streams).
    """

    table: ClassVar[str] = "coder"
    name: ClassVar[str]
    #: the coder computes the CRC-32 in its own stream (its library config has ``crc32``)
    native_crc: ClassVar[bool] = False
    crc32: bool = False

    def build(self, method: MethodConfig, *, client_strategy: str) -> Coder:
        """The :class:`sidejax.coding.Coder` for ``method``'s messages; ``client_strategy`` (``map`` or
        ``vmap``, resolved) is how the engine runs the clients."""
        raise NotImplementedError

    def checked(self, method: MethodConfig, *, client_strategy: str):
        """:meth:`build`'s coder (or coder factory), with :func:`sidejax.coding.with_crc` when ``crc32`` is
        set and the coder has no check of its own: what a method is given."""
        built = self.build(method, client_strategy=client_strategy)
        if not self.crc32 or self.native_crc:
            return built
        if isinstance(built, Coder):
            return with_crc(built)
        return lambda *args, **kwargs: with_crc(built(*args, **kwargs))  # a factory (pseudocoreset)


@dataclass(frozen=True)
@fills(KLMSConfig, skip=_ENGINE_FIELDS, choices={"trigger": TRIGGERS})
class KLMSCoderConfig(CoderConfig):
    """KLMS (:class:`sidejax.coding.KLMSConfig`'s fields; the engine-dependent ``bucket_update_rounds``
    follows the client strategy).

    Attributes:
      rho_threshold: rho trigger: re-partition when the mean rho exceeds this (unset: 3, as the reference
        code).
    """

    name: ClassVar[str] = "klms"
    native_crc: ClassVar[bool] = True
    rho_threshold: float | None = None

    conditional: ClassVar = {
        "dbar_min": ("trigger", ("thresholds",), False),
        "dbar_max": ("trigger", ("thresholds",), False),
        "rho_threshold": ("trigger", ("rho",), False),
    }

    def check(self) -> None:
        self.klms_config()

    def klms_config(self, **extra) -> KLMSConfig:
        """The :class:`sidejax.coding.KLMSConfig` of these fields (``extra``: its other fields)."""
        return self.checked_library_value(KLMSConfig, crc32=self.crc32, **extra)

    def build(self, method: MethodConfig, *, client_strategy: str) -> Coder:
        # each client's own bucket only pays off when clients run one after another (under vmap every
        # bucket's branch would run for the batch)
        return klms_coder(self.klms_config(bucket_update_rounds=client_strategy == "map"))


@dataclass(frozen=True)
@fills(KLMSAvgConfig, skip=_ENGINE_FIELDS)
class KLMSAvgCoderConfig(CoderConfig):
    """KLMS with BICompFL's Adaptive-Avg allocation (:class:`sidejax.coding.KLMSAvgConfig`'s fields): equal
    blocks of one adaptive size, K* bits per block."""

    name: ClassVar[str] = "klms_avg"
    native_crc: ClassVar[bool] = True

    def check(self) -> None:
        self.config()

    def config(self) -> KLMSAvgConfig:
        return self.checked_library_value(KLMSAvgConfig, crc32=self.crc32)

    def build(self, method: MethodConfig, *, client_strategy: str) -> Coder:
        return klms_avg_coder(self.config())


def _fieldless(name: str, doc: str, make: Callable[[MethodConfig], Coder]) -> type[CoderConfig]:
    """The config of coder ``name``, which has no fields of its own (``crc32`` aside): its coder for a
    method is ``make(method)``."""

    def build(self, method: MethodConfig, *, client_strategy: str) -> Coder:
        return make(method)

    title = "".join(part.title() for part in name.split("_")) + "CoderConfig"
    namespace = {"__doc__": doc, "__module__": __name__, "__qualname__": title, "name": name, "build": build}
    return dataclass(frozen=True)(type(title, (CoderConfig,), namespace))


Float32CoderConfig = _fieldless(
    "float32", "The uncompressed coder: 32 bits per coordinate.", lambda method: float32_coder()
)
SignsCoderConfig = _fieldless(
    "signs",
    "Signs sent as one bit each, ``fixed_width_coder((-1.0, 1.0))``.",
    lambda method: fixed_width_coder((-1.0, 1.0)),
)
EliasCoderConfig = _fieldless(
    "elias",
    "QSGD's Elias stream of the levels in ``[-s, s]``; ``s`` is the method's ``levels``.",
    lambda method: elias_coder(method.levels),
)
MaskCoderConfig = _fieldless(
    "mask", "A binary mask sent as Golomb-coded run lengths.", lambda method: mask_coder()
)
ScaledSignCoderConfig = _fieldless(
    "scaled_sign",
    "The deterministic scaled sign (||v||_1 / d) sign(v): a float32 scale, then one bit per coordinate.",
    lambda method: scaled_sign_coder(),
)
PseudocoresetCoderConfig = _fieldless(
    "pseudocoreset",
    """BPC-FL's uplink of a pseudocoreset, :func:`sidejax.coding.pseudocoreset_coder`: K·D float32 inputs, K
    labels in ceil(log2 C) bits each, the example count in 32 bits. Its label width depends on the dataset,
    so its coder is the factory ``coder(num_classes)`` the method calls.""",
    lambda method: functools.partial(pseudocoreset_coder, method.num_points),
)


#: CEPAM's lattices by name (``[coder] lattice``)
LATTICES = {
    "z1": lambda: integer_lattice(1),
    "z2": lambda: integer_lattice(2),
    "z3": lambda: integer_lattice(3),
    "a2": hexagonal,
    "d4": d4,
    "e8": e8,
}
_NOISES = ("gauss", "laplace")
_CLIP_MODES = ("normalise", "clip")


@dataclass(frozen=True)
class MechanismConfig(CoderConfig):
    """Fields shared by the privacy mechanisms.

    Attributes:
      noise: gauss (N(0, level^2) per coordinate) or laplace (Lap(0, level)).
      level: the noise level sigma or b (> 0), in the units of the normalised update: one value for every
        client, or several, given to the clients in turn (client i gets level i mod count) and agreed with
        the server at initialisation (privacy adaptability).
      gamma: the normalisation scale: the update is normalised (or clipped) to norm gamma before the noise.
      clip: normalise (the paper: X gamma/||X||, ||X|| sent as float32, the server rescales) or clip
        (DP-correct: X min(1, gamma/||X||), no rescaling).
    """

    noise: str = choice("gauss", _NOISES)
    level: tuple[float, ...] = (0.1,)
    gamma: float = 1.0
    clip: str = choice("normalise", _CLIP_MODES)

    limits: ClassVar = {
        "in (0, inf)": "level",
        "> 0": "gamma",
        ">= 0": "sdq_step",
        "in [4, 96]": "capacity_bits_per_coordinate",
    }

    def check(self) -> None:
        self.require(len(self.level) >= 1, "level", "needs one value or more (sigma or b)")

    def client_levels(self, num_clients: int) -> list[float] | None:
        """Every client's level when :attr:`level` has several (``None`` for one: the coder's own level)."""
        if len(self.level) == 1:
            return None
        return [self.level[i % len(self.level)] for i in range(num_clients)]

    def mechanism_noise(self):
        """The coder's noise, at the smallest level (each client's own level reaches the coder with the
        prior when there are several, :func:`sidejax.algorithms.cepam`)."""
        return (GaussianNoise if self.noise == "gauss" else LaplaceNoise)(min(self.level))


@dataclass(frozen=True)
class LRSUQCoderConfig(MechanismConfig):
    """CEPAM: LRSUQ on a lattice, the quantization error exactly the noise (docs/papers/cepam.md#s2-5).

    Attributes:
      lattice: z1, z2, z3 (the paper), a2, d4 or e8 (higher packing density: fewer trials); laplace needs z1.
      capacity_bits_per_coordinate: static stream buffer per coordinate (an update that needs more is
        reported invalid and stops the run, naming this field).
    """

    name: ClassVar[str] = "lrsuq"
    lattice: str = choice("z1", tuple(LATTICES))
    capacity_bits_per_coordinate: int = 16

    def check(self) -> None:
        super().check()
        self.require(
            self.noise == "gauss" or self.lattice == "z1", "lattice", "must be z1 for laplace noise (n = 1)"
        )

    def build(self, method: MethodConfig, *, client_strategy: str) -> Coder:
        inner = lrsuq_coder(
            LATTICES[self.lattice](),
            self.mechanism_noise(),
            capacity_bits_per_coordinate=self.capacity_bits_per_coordinate,
        )
        return clip_update(inner, gamma=self.gamma, mode=self.clip)


@dataclass(frozen=True)
class NoiseCoderConfig(MechanismConfig):
    """FL + Gaussian / Laplace mechanism: private noise added to the normalised update, sent as float32
    (``sdq_step = 0``) or quantized by scalar SDQ with step sdq_step (FL + noise + SDQ).

    Attributes:
      sdq_step: 0 for float32, else the SDQ step Delta (> 0).
    """

    name: ClassVar[str] = "noise"
    sdq_step: float = 0.0

    def build(self, method: MethodConfig, *, client_strategy: str) -> Coder:
        inner = sdq_coder(integer_lattice(1, self.sdq_step)) if self.sdq_step > 0 else None
        return clip_update(
            additive_noise_coder(self.mechanism_noise(), inner), gamma=self.gamma, mode=self.clip
        )


@dataclass(frozen=True)
class SDQCoderConfig(CoderConfig):
    """FL + SDQ: scalar subtractive dithered quantization of the raw update (no noise, no normalisation).

    Attributes:
      step: the quantization step Delta (> 0); the error is Unif[-Delta/2, Delta/2).
      capacity_bits_per_coordinate: static stream buffer per coordinate.
    """

    name: ClassVar[str] = "sdq"
    step: float = 1e-3
    capacity_bits_per_coordinate: int = 16
    limits: ClassVar = {"> 0": "step", "in [4, 96]": "capacity_bits_per_coordinate"}

    def build(self, method: MethodConfig, *, client_strategy: str) -> Coder:
        return sdq_coder(
            integer_lattice(1, self.step), capacity_bits_per_coordinate=self.capacity_bits_per_coordinate
        )


@dataclass(frozen=True)
class TopKCoderConfig(CoderConfig):
    """TopK (:func:`sidejax.coding.topk_coder`): the K = floor(d / divisor) coordinates of largest magnitude,
    as K float32 values and K positions of ceil(log2 d) bits. Its coder is the factory ``coder(num_clients)``
    the method calls (M3: K = floor(d/n) with the divisor unset).

    Attributes:
      divisor: keep K = floor(d / divisor) coordinates (unset: the number of clients per round).
    """

    name: ClassVar[str] = "topk"
    limits: ClassVar = {">= 1": "divisor"}

    divisor: int | None = None

    def build(self, method: MethodConfig, *, client_strategy: str):
        return lambda num_clients: topk_coder(num_clients if self.divisor is None else self.divisor)


#: the coder configs by ``[coder] name``
CODERS: dict[str, type[CoderConfig]] = by_name(
    KLMSCoderConfig,
    Float32CoderConfig,
    SignsCoderConfig,
    EliasCoderConfig,
    MaskCoderConfig,
    KLMSAvgCoderConfig,
    ScaledSignCoderConfig,
    LRSUQCoderConfig,
    NoiseCoderConfig,
    SDQCoderConfig,
    PseudocoresetCoderConfig,
    TopKCoderConfig,
)
