"""Typed experiment configuration and named presets (TOML files in ``experiments/presets/``)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ExperimentConfig",
    "PRESET_DIR",
    "list_presets",
    "load_preset",
    "preset_description",
    "config_from_dict",
    "field_docs",
]

PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything that defines a run. Field names are the TOML keys and (with ``-``) the CLI flags.

    Attributes:
      algorithm: registered algorithm name (``python -m experiments.run --help`` lists them).
      dataset: :data:`sidejax.data.DATASETS` name.
      model: :data:`sidejax.models.MODELS` name.
      num_clients: clients in the federation.
      participation: fraction of clients sampled per round (without replacement); at least one client.
      rounds: communication rounds.
      local_epochs: local epochs per round.
      batch_size: local minibatch size.
      client_optimizer: ``sgd``, ``momentum`` (SGD with momentum 0.9) or ``adam``.
      client_lr: local learning rate.
      server_optimizer: ``none`` (plain averaging), ``sgd``, ``momentum`` or ``adam`` (FedOpt).
      server_lr: server learning rate (ignored with ``none``).
      partition: ``iid``, ``shards``, ``klms_noniid``, ``dirichlet`` or ``fixed``.
      c_max: classes per client for ``shards``/``klms_noniid``.
      alpha: Dirichlet concentration for ``dirichlet``.
      examples_per_client: per-client size for ``fixed``.
      train_subset: if > 0, use a fixed random subset of this many training examples (reduced-scale runs).
      seed: the run's seed; every key derives from it (:func:`sidejax.keys.run_keys`).
      eval_every: rounds per jit call; the test set is evaluated and a checkpoint written after each.
      eval_batch_size: batch size of evaluation.
      client_strategy: ``auto`` (the library's backend default, :func:`sidejax.fl.default_client_strategy`:
        ``map`` on CPU, ``vmap`` on GPU/TPU), or ``map`` (sequential) / ``vmap`` to force one.
      stop_at_accuracy: if > 0, stop once test accuracy (a fraction, e.g. 0.9) reaches it.
      log2_candidates: KLMS ``log2 K`` (candidates per block), also the target KL per block in bits.
      klms_overhead_bits: KLMS overhead r: blocks carry ``log2_candidates - r`` bits of KL.
      klms_adaptive: Adaptive-KLMS (KL-sized blocks, update protocol) if true, Fixed-KLMS if false.
      block_size: Fixed-KLMS block size, and the initial Adaptive-KLMS partition.
      max_block_size: Adaptive-KLMS cap on block length (power of two).
      klms_trigger: ``thresholds`` (paper) or ``rho`` (reference code) re-partition rule.
      klms_dbar_min: ``thresholds`` trigger: re-partition when the mean block KL (bits) falls below this;
        0 means the default ``D_target / 3``.
      klms_dbar_max: re-partition when it rises above this; 0 means the default ``2 * D_target``.
      fedpm_estimator: FedPM's gradient estimator through the mask sample, ``fedpm`` or ``ste``.
      qsgd_levels: QSGD quantisation levels s (QSGD baseline; QLSD uses it too).
      sign_temperature: stochastic SignSGD uses ``P(+1) = sigmoid(temperature * v / max|v|)`` per tensor.
      sgld_step_size: Langevin step size gamma (QLSD, SGLD-KLMS).
      prior_weight_decay: Gaussian-prior weight decay of the Langevin potential ([C] 5).
      paper_compat: QSGD/QLSD charge the reference code's Elias bound (with its precedence bug) instead of
        the exact Elias stream length.
    """

    algorithm: str = "fedavg"
    dataset: str = "digits"
    model: str = "mlp_100"
    num_clients: int = 10
    participation: float = 1.0
    rounds: int = 20
    local_epochs: int = 1
    batch_size: int = 32
    client_optimizer: str = "sgd"
    client_lr: float = 0.05
    server_optimizer: str = "none"
    server_lr: float = 1.0
    partition: str = "iid"
    c_max: int = 2
    alpha: float = 0.5
    examples_per_client: int = 0
    train_subset: int = 0
    seed: int = 0
    eval_every: int = 1
    eval_batch_size: int = 1000
    client_strategy: str = "auto"
    stop_at_accuracy: float = 0.0
    log2_candidates: int = 2
    klms_overhead_bits: float = 0.0
    klms_adaptive: bool = True
    block_size: int = 8
    max_block_size: int = 256
    klms_trigger: str = "thresholds"
    klms_dbar_min: float = 0.0
    klms_dbar_max: float = 0.0
    fedpm_estimator: str = "fedpm"
    qsgd_levels: int = 1
    sign_temperature: float = 20.0
    sgld_step_size: float = 1e-5
    prior_weight_decay: float = 5.0
    paper_compat: bool = False

    def __post_init__(self):
        checks = {
            "num_clients": self.num_clients >= 1,
            "participation": 0.0 < self.participation <= 1.0,
            "rounds": self.rounds >= 1,
            "local_epochs": self.local_epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "client_lr": self.client_lr > 0,
            "server_lr": self.server_lr > 0,
            "eval_every": self.eval_every >= 1,
            "eval_batch_size": self.eval_batch_size >= 1,
            "train_subset": self.train_subset >= 0,
            "stop_at_accuracy": 0.0 <= self.stop_at_accuracy <= 1.0,
            "log2_candidates": 0 <= self.log2_candidates <= 24,
            "block_size": self.block_size >= 1,
            "klms_dbar_min": self.klms_dbar_min >= 0,
            "klms_dbar_max": self.klms_dbar_max >= 0,
            "max_block_size": self.max_block_size >= 2
            and self.max_block_size & (self.max_block_size - 1) == 0,
            "qsgd_levels": self.qsgd_levels >= 1,
            "sign_temperature": self.sign_temperature > 0,
            "sgld_step_size": self.sgld_step_size > 0,
            "prior_weight_decay": self.prior_weight_decay >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: see ExperimentConfig's docstring")
        if self.client_strategy not in ("auto", "map", "vmap"):
            raise ValueError(f"client_strategy must be 'auto', 'map' or 'vmap', got {self.client_strategy!r}")

    @property
    def clients_per_round(self) -> int:
        return max(1, round(self.participation * self.num_clients))

    def replace(self, **changes: Any) -> ExperimentConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(ExperimentConfig)}


def config_from_dict(values: dict[str, Any], *, source: str = "config") -> ExperimentConfig:
    """Builds a config, checking every key and its type (ints are accepted where floats are expected)."""
    for key, value in values.items():
        if key not in _FIELDS:
            raise ValueError(f"{source}: unknown key {key!r}; valid keys: {sorted(_FIELDS)}")
        expected = type(_FIELDS[key].default)
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"{source}: key {key!r} must be {expected.__name__}, got {value!r}")
    values = {k: (float(v) if type(_FIELDS[k].default) is float else v) for k, v in values.items()}
    return ExperimentConfig(**values)


def list_presets() -> list[str]:
    """Names of the presets shipped in ``experiments/presets``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _read_preset(name: str) -> tuple[Path, dict[str, Any]]:
    path = PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; valid presets: {list_presets()}")
    with path.open("rb") as f:
        return path, tomllib.load(f)


def load_preset(name: str) -> ExperimentConfig:
    """Loads ``experiments/presets/<name>.toml`` into a checked :class:`ExperimentConfig`.

    A preset sets its fields completely: fields it leaves out take :class:`ExperimentConfig`'s defaults (not
    the per-algorithm CLI defaults), so a preset means the same run whatever those defaults become.
    """
    path, values = _read_preset(name)
    values.pop("description", None)
    return config_from_dict(values, source=str(path))


def preset_description(name: str) -> str:
    """The ``description`` line of a preset (every shipped preset has one)."""
    path, values = _read_preset(name)
    if not isinstance(values.get("description"), str) or not values["description"].strip():
        raise ValueError(f"{path}: the preset has no description")
    return values["description"]


def field_docs() -> dict[str, str]:
    """One line of help per config field, from the ``Attributes:`` section of :class:`ExperimentConfig`."""
    doc = ExperimentConfig.__doc__ or ""
    docs: dict[str, str] = {}
    name = None
    for line in doc.split("Attributes:", 1)[-1].splitlines():
        m = re.match(r"^      (\w+): (.*)$", line)
        if m and m.group(1) in _FIELDS:
            name = m.group(1)
            docs[name] = m.group(2).strip()
        elif name and line.startswith("        "):
            docs[name] += " " + line.strip()
        elif line.strip():
            name = None
    return {k: re.sub(r":\w+:`([^`]*)`", r"\1", v).replace("``", "") for k, v in docs.items()}
