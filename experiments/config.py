"""Typed experiment configuration: four sections, and named presets (TOML files in ``experiments/presets/``).

An :class:`ExperimentConfig` is ``run`` (:class:`RunConfig`), ``data`` (:class:`DataConfig`), ``method``
(one of :data:`experiments.methods.METHODS`) and ``coder`` (one of :data:`experiments.coders.CODERS`). A
preset is the same four TOML tables plus a ``description``::

    description = "FedPM-KLMS on the bundled digits"
    [run]
    rounds = 20
    [data]
    dataset = "digits"
    model = "mlp_100"
    [method]
    name = "fedpm"
    client_lr = 0.1
    [coder]
    name = "klms"
    log2_num_candidates = 4

A key a section does not have (a typo, or a field of another method) and a value of the wrong type are
errors naming the file, the table and the key. Fields a preset leaves out take their class's defaults (for
``[method]`` the method's tuned values, for ``[coder]`` sidejax's, e.g. :class:`sidejax.coding.KLMSConfig`'s;
a field that is unset, ``None``, has no TOML value and is left out); a preset without a ``[coder]`` table
uses the method's default coder. The shipped presets write out every field they set.

Dotted keys (``"method.client_lr"``) address fields in :meth:`ExperimentConfig.override` and
:func:`default_config`, and as ``--method.client_lr`` on the command line.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from experiments.coders import CODERS, CoderConfig, Float32CoderConfig
from experiments.methods import METHODS, FedAvgConfig, MethodConfig, algorithm_name, parse_algorithm
from experiments.sections import Section, choice, coerce_value
from sidejax.data import DATASETS, EMNIST_SUBSETS, PARTITION_KINDS
from sidejax.models import MODELS

__all__ = [
    "RunConfig",
    "DataConfig",
    "ExperimentConfig",
    "TABLES",
    "PRESET_DIR",
    "OldConfigError",
    "default_config",
    "config_from_dict",
    "list_presets",
    "load_preset",
    "preset_description",
    "preset_toml",
    "field_docs",
]

PRESET_DIR = Path(__file__).parent / "presets"
TABLES = ("run", "data", "method", "coder")


@dataclass(frozen=True)
class RunConfig(Section):
    """How the rounds run and are evaluated.

    Attributes:
      seed: the run's seed; every key derives from it (sidejax.keys.run_keys), and the data partition and
        train_subset draw from it.
      rounds: communication rounds.
      eval_every: rounds per jit call; the test set is evaluated and a checkpoint written after each.
      clients_per_step: run each round's participants in parts of this many, each part its own jit call
        followed by a checkpoint of the round so far (sidejax.fl.run_clients): a long client phase (BPC-FL's
        one round) is then resumed from its last part, not from the round's start. The same keys per
        client, so the same bits (with client_strategy map, the CPU default). Unset: each chunk of rounds
        in one call.
      eval_batch_size: batch size of evaluation.
      client_strategy: auto (the library's backend default, sidejax.fl.default_client_strategy: map on CPU,
        vmap on GPU/TPU), or map (sequential) / vmap to force one.
      devices: how many devices share each round's participants (the first N of jax.devices(), which
        counts every process's devices; 1: one device). With processes > 1 it must be every device of every
        process. Part of the configuration, so a run resumes only on the same number. On CPU,
        XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices.
      processes: how many processes (hosts) run this experiment together (jax.distributed; 1: this process
        alone). Start each with the same preset and flags, except process_id. Part of the configuration.
      coordinator: with processes > 1, the address (host:port) of process 0, where the others connect. A
        launch setting: not compared on resume, nor between the processes.
      process_id: this process's number, 0 to processes - 1; process 0 coordinates and alone writes the
        results folder. A launch setting, like coordinator.
      stop_at_accuracy: stop once test accuracy (a fraction, e.g. 0.9) reaches this (unset: never).
      init_from: the results folder of a finished run whose final model (its final_params/, for a posterior
        the first sample) starts this run instead of a fresh initialisation (BPC-FL's MAP as a FedAvg warm
        start); it must be the same model (unset: a fresh initialisation from the seed).
    """

    table: ClassVar[str] = "run"
    seed: int = 0
    rounds: int = 20
    eval_every: int = 1
    clients_per_step: int | None = None
    eval_batch_size: int = 1000
    client_strategy: str = choice("auto", ("auto", "map", "vmap"))
    devices: int = 1
    processes: int = 1
    coordinator: str | None = None
    process_id: int = 0
    stop_at_accuracy: float | None = None
    init_from: str | None = None

    limits: ClassVar = {
        ">= 0": "seed",
        ">= 1": "rounds eval_every clients_per_step eval_batch_size devices processes",
        "in (0, 1]": "stop_at_accuracy",
    }

    def check(self) -> None:
        self.require(0 <= self.process_id < self.processes, "process_id", "must be in [0, processes)")
        self.require(
            self.processes == 1 or bool(self.coordinator),
            "coordinator",
            "is needed with processes > 1: the host:port of process 0 (e.g. 127.0.0.1:8476)",
        )
        self.require(
            self.processes == 1 or self.devices >= self.processes,
            "devices",
            "must count every device of every process (at least one per process) when processes > 1",
        )


_LABEL_SKEW = ("shards", "klms_noniid")
#: the partition with per-client train and test sets (sidejax.data.label_split_train_test)
PFEDME = "pfedme"


@dataclass(frozen=True)
class DataConfig(Section):
    """The dataset, the model and the federation.

    Attributes:
      dataset: sidejax.data.DATASETS name.
      model: sidejax.models.MODELS name.
      num_clients: clients in the federation.
      participation: fraction of clients sampled per round (without replacement); at least one client.
      partition: iid, shards, klms_noniid, dirichlet or fixed (sidejax.data.partition of the training set,
        evaluated on the test set), or pfedme: pFedMe's split of the pooled train and test sets into a train
        and a test set per client (sidejax.data.label_split_train_test); the global model is evaluated on the
        union of the clients' test sets, a personalized method's personal models each on its client's.
      c_max: classes per client, for (and needed by) partition shards or klms_noniid.
      alpha: Dirichlet concentration, for (and needed by) partition dirichlet.
      examples_per_client: per-client size, for (and needed by) partition fixed.
      labels_per_client: labels per client, for (and needed by) partition pfedme (client u holds labels
        (labels_per_client * u + j) mod num_classes, j < labels_per_client).
      examples_per_label: examples of each of its labels a client gets (train and test together), for (and
        needed by) partition pfedme.
      train_fraction: fraction of a client's examples in its train set (the rest is its test set), in (0, 1),
        for (and needed by) partition pfedme.
      subset: the EMNIST split, for dataset emnist (byclass: EMNIST-62, BPC-FL's; unset: balanced).
      train_subset: use a fixed random subset of this many training examples (reduced-scale runs; unset:
        all of them); not with partition pfedme, which sets the clients' sizes itself.
    """

    table: ClassVar[str] = "data"
    conditional: ClassVar = {
        "c_max": ("partition", _LABEL_SKEW, True),
        "alpha": ("partition", ("dirichlet",), True),
        "examples_per_client": ("partition", ("fixed",), True),
        "labels_per_client": ("partition", ("pfedme",), True),
        "examples_per_label": ("partition", ("pfedme",), True),
        "train_fraction": ("partition", ("pfedme",), True),
        "subset": ("dataset", ("emnist",), False),
    }

    dataset: str = choice("digits", tuple(DATASETS))
    model: str = choice("mlp_100", tuple(MODELS))
    num_clients: int = 10
    participation: float = 1.0
    partition: str = choice("iid", (*PARTITION_KINDS, PFEDME))
    c_max: int | None = None
    alpha: float | None = None
    examples_per_client: int | None = None
    labels_per_client: int | None = None
    examples_per_label: int | None = None
    train_fraction: float | None = None
    train_subset: int | None = None
    subset: str | None = None

    limits: ClassVar = {
        ">= 1": "num_clients c_max examples_per_client labels_per_client examples_per_label train_subset",
        "in (0, 1]": "participation",
        "> 0": "alpha",
        "in (0, 1)": "train_fraction",
    }

    def check(self) -> None:
        self.require(
            self.subset is None or self.subset in EMNIST_SUBSETS,
            "subset",
            f"must be one of {', '.join(EMNIST_SUBSETS)} (or unset: balanced)",
        )
        self.require(
            self.partition != PFEDME or self.train_subset is None,
            "train_subset",
            "is not used with partition pfedme: that split draws examples_per_label examples per client and "
            "label from the pooled train and test sets; lower examples_per_label for a smaller run",
        )

    @property
    def clients_per_round(self) -> int:
        """``round(participation * num_clients)``, at least one."""
        return max(1, round(self.participation * self.num_clients))

    @property
    def per_client_test(self) -> bool:
        """Whether every client has its own test set (partition pfedme)."""
        return self.partition == PFEDME

    def dataset_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`sidejax.data.load_dataset` (EMNIST's subset when set)."""
        return {"subset": self.subset} if self.subset is not None else {}

    def partition_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`sidejax.data.partition` for :attr:`partition`; for ``pfedme``
        (not a :func:`~sidejax.data.partition` kind) those of :func:`sidejax.data.label_split_train_test`."""
        return {
            name: getattr(self, name)
            for name, (_, kinds, _) in self.conditional.items()
            if self.partition in kinds
        }


class OldConfigError(ValueError):
    """A flat configuration, as written by sidejax before the sectioned config."""


_OLD_KEYS = {"algorithm", "dataset", "model", "rounds", "num_clients", "client_lr", "seed"}


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything that defines a run: four typed sections.

    Attributes:
      run: seed, rounds, evaluation, client strategy.
      data: dataset, model, federation and partition.
      method: the federated method's config (its class is the method: ``method.name``).
      coder: the coder's config (``coder.name``); the method must accept it.
    """

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    method: MethodConfig = dataclasses.field(default_factory=FedAvgConfig)
    coder: CoderConfig = dataclasses.field(default_factory=Float32CoderConfig)

    def __post_init__(self):
        kinds = {"run": RunConfig, "data": DataConfig, "method": MethodConfig, "coder": CoderConfig}
        for table, kind in kinds.items():
            if not isinstance(getattr(self, table), kind):
                raise TypeError(f"{table} must be a {kind.__name__}, got {getattr(self, table)!r}")
        self.method.check_coder(self.coder)
        if self.method.one_shot:
            if self.run.rounds != 1:
                raise ValueError(
                    f"run.rounds must be 1 for {self.method.name}: it is one-shot (every client uploads "
                    f"once); got {self.run.rounds}"
                )
            if self.data.clients_per_round != self.data.num_clients:
                raise ValueError(
                    f"data.participation must be 1 for {self.method.name}: it is one-shot, every client "
                    f"uploads in its one round; got participation {self.data.participation}"
                )

    @property
    def algorithm(self) -> str:
        """The algorithm's name in tables and plots: a shortcut (``fedpm_klms``) or ``method+coder``."""
        return algorithm_name(self.method.name, self.coder.name)

    @property
    def clients_per_round(self) -> int:
        return self.data.clients_per_round

    def replace(self, **sections: Section) -> ExperimentConfig:
        """This config with whole sections replaced (``config.replace(run=...)``); see :meth:`override` to
        change single fields."""
        return dataclasses.replace(self, **sections)

    def override(self, values: Mapping[str, Any], *, source: str = "overrides") -> ExperimentConfig:
        """This config with fields changed by dotted keys (``{"run.rounds": 5, "method.client_lr": 0.1}``).

        ``method.name`` starts a new method section from that method's defaults (unless it is the current
        method); the coder stays if the new method accepts it, else it becomes the method's default coder.
        ``coder.name`` likewise starts a coder section, from its defaults as tuned for the method. Giving
        ``local_steps`` unsets ``local_epochs`` (and back), and changing a field that others depend on unsets
        those that no longer apply (a new ``data.partition`` drops the old one's ``c_max``).

        Raises:
          ValueError: an unknown section, method, coder or key (the message names it and lists the valid
            ones), a wrong type or an invalid value.
        """
        given = _split_dotted(values, source)
        method_name, coder_name = self.names_after(values, source=source)
        bases: dict[str, Any] = {table: getattr(self, table).to_dict() for table in TABLES}
        for table, name in (("method", method_name), ("coder", coder_name)):
            given[table].pop("name", None)
            if bases[table].pop("name") != name:  # another method or coder starts from its defaults
                bases[table] = None
        return _build(given, source, method_name=method_name, coder_name=coder_name, bases=bases)

    def names_after(self, values: Mapping[str, Any], *, source: str = "overrides") -> tuple[str, str]:
        """The (method, coder) names of :meth:`override` ``(values)``: ``method.name`` if given, else this
        config's; ``coder.name`` if given, else this config's coder if the method takes it, else the method's
        default coder."""
        method_name = values.get("method.name", self.method.name)
        method_cls = _lookup(METHODS, "method", method_name, source)
        coder_name = values.get("coder.name")
        if coder_name is None:
            coder_name = self.coder.name if self.coder.name in method_cls.coders else method_cls.default_coder
        return method_name, coder_name

    def to_dict(self) -> dict[str, Any]:
        """``{"run": {...}, "data": {...}, "method": {"name": ..., ...}, "coder": {"name": ..., ...}}``
        (unset fields as ``None``)."""
        return {table: getattr(self, table).to_dict() for table in TABLES}

    def flat(self) -> dict[str, Any]:
        """Every field under its dotted key (``"method.client_lr"``), names included."""
        return {f"{table}.{k}": v for table in TABLES for k, v in getattr(self, table).to_dict().items()}


def _lookup(registry: Mapping[str, type], table: str, name: Any, source: str) -> type:
    if name not in registry:
        raise ValueError(f"{source}: [{table}] unknown name {name!r}; valid names: {', '.join(registry)}")
    return registry[name]


def _split_dotted(values: Mapping[str, Any], source: str) -> dict[str, dict[str, Any]]:
    given: dict[str, dict[str, Any]] = {table: {} for table in TABLES}
    for key, value in values.items():
        table, dot, name = key.partition(".")
        if table not in given or not dot or not name:
            raise ValueError(
                f"{source}: {key!r} is not a dotted key <table>.<field>; tables: {', '.join(TABLES)}"
            )
        given[table][name] = value
    return given


def _owners(registry: Mapping[str, type[Section]], key: str) -> list[str]:
    return [name for name, cls in registry.items() if key in cls.field_names()]


def _section(
    cls: type[Section], base: Mapping[str, Any], given: Mapping[str, Any], source: str, registry=None
) -> Section:
    """``cls`` from ``given`` (checked key by key, then merged onto ``base``), errors naming ``source``, the
    table and the key. ``registry``: the classes of a named table (methods, coders)."""
    head = f"{source}: [{cls.table}]"
    valid = ", ".join(("name", *cls.field_names()) if registry else cls.field_names())
    checked = {}
    for key, value in given.items():
        if key not in cls.field_names():
            others = _owners(registry, key) if registry else []
            if others:
                raise ValueError(
                    f"{head} key {key!r} is not a field of {cls.table} {cls.name!r} ({cls.table}s with it: "
                    f"{', '.join(others)}); valid keys: {valid}"
                )
            of = f" for {cls.table} {cls.name!r}" if registry else ""
            raise ValueError(f"{head} unknown key {key!r}{of}; valid keys: {valid}")
        try:
            checked[key] = coerce_value(cls, key, value)
        except TypeError as e:
            raise ValueError(f"{head} key {key!r} {e}") from None
    try:
        return cls(**cls.merge(base, checked))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _fresh_coder(method_cls: type[MethodConfig], coder_cls: type[CoderConfig]) -> dict[str, Any]:
    return {**coder_cls.defaults(), **method_cls.coder_defaults.get(coder_cls.name, {})}


def _build(
    given: Mapping[str, Mapping[str, Any]],
    source: str,
    *,
    method_name: str,
    coder_name: str,
    bases: Mapping[str, Mapping[str, Any] | None],
) -> ExperimentConfig:
    """The config of ``given`` tables (names removed) applied on ``bases`` (``None``: a fresh section)."""
    method_cls = _lookup(METHODS, "method", method_name, source)
    coder_cls = _lookup(CODERS, "coder", coder_name, source)
    run = _section(RunConfig, bases["run"] or RunConfig.defaults(), given["run"], source)
    data = _section(DataConfig, bases["data"] or DataConfig.defaults(), given["data"], source)
    method_base = bases["method"] if bases["method"] is not None else method_cls.defaults()
    method = _section(method_cls, method_base, given["method"], source, METHODS)
    coder_base = bases["coder"] if bases["coder"] is not None else _fresh_coder(method_cls, coder_cls)
    coder = _section(coder_cls, coder_base, given["coder"], source, CODERS)
    try:
        return ExperimentConfig(run=run, data=data, method=method, coder=coder)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _upgrade_noise_levels(given: dict[str, dict[str, Any]], source: str) -> None:
    """A CEPAM config written before the noise level had one home (``[method] noise_levels``, a
    comma-separated string, beside ``[coder] level``): the levels move to ``[coder] level``, a list."""
    text = given["method"].pop("noise_levels", None)
    if text is None or (isinstance(text, str) and not text.strip()):
        return
    coder = given["coder"].get("name", METHODS["cepam"].default_coder)
    try:
        levels = [float(v) for v in text.split(",")]
    except (AttributeError, ValueError):
        levels = None
    if levels is None or coder not in ("lrsuq", "noise"):
        raise ValueError(
            f"{source}: [method] noise_levels {text!r} is no longer a field: the per-client noise levels are "
            f"[coder] level, a list (lrsuq and noise coders); write them there "
            f"(--coder.level 0.05 0.1 0.2) and remove noise_levels"
        )
    given["coder"]["level"] = levels


def config_from_dict(values: Mapping[str, Any], *, source: str = "config") -> ExperimentConfig:
    """The config of nested tables (a preset's TOML, ``config.json``), every key and type checked.

    ``[method]`` needs a ``name``; ``[coder]`` without one (or missing) is the method's default coder. A
    field left out takes its section's default: the method's (tuned) defaults, and the coder's own
    defaults, not the coder fields as tuned for the method (those may set a field that TOML has no way to
    unset, such as ``dbar_min``).

    Raises:
      OldConfigError: a flat configuration written by an older sidejax version.
      ValueError: a missing or unknown table or key, a wrong type or an invalid value (the message names
        ``source``, the table and the key and lists the valid keys).
    """
    if not any(t in values for t in TABLES) and _OLD_KEYS & set(values):
        raise OldConfigError(
            f"{source}: a flat configuration (keys such as {', '.join(sorted(_OLD_KEYS & set(values)))}), "
            f"written by an older sidejax version; this version reads [run], [data], [method] and [coder] "
            f"tables"
        )
    unknown = sorted(set(values) - set(TABLES))
    if unknown:
        raise ValueError(
            f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; valid tables: {', '.join(TABLES)}"
        )
    for table in TABLES:
        if not isinstance(values.get(table, {}), Mapping):
            raise ValueError(f"{source}: {table!r} must be a table, got {values[table]!r}")
    given = {table: dict(values.get(table, {})) for table in TABLES}
    if given["method"].get("name") == "cepam":
        _upgrade_noise_levels(given, source)
    if "name" not in given["method"]:
        raise ValueError(f"{source}: [method] needs a name; valid names: {', '.join(METHODS)}")
    method_name = given["method"].pop("name")
    method_cls = _lookup(METHODS, "method", method_name, source)
    coder_name = given["coder"].pop("name", method_cls.default_coder)
    coder_base = _lookup(CODERS, "coder", coder_name, source).defaults()  # not the method's tuning: see above
    bases = {"run": None, "data": None, "method": None, "coder": coder_base}
    return _build(given, source, method_name=method_name, coder_name=coder_name, bases=bases)


def default_config(algorithm: str | None = None, **overrides: Any) -> ExperimentConfig:
    """The configuration of ``algorithm`` from defaults: each section's defaults (the method's tuned values,
    its coder as tuned for it, and its :attr:`~experiments.methods.MethodConfig.run_defaults`), then the
    dotted ``overrides`` (``default_config("fedpm", **{"method.client_lr": 0.2, "run.rounds": 5})``).

    Args:
      algorithm: a shortcut (``fedpm_klms``) or ``method+coder``; may be left out if ``overrides`` has
        ``method.name`` (and optionally ``coder.name``).
    """
    method_name, coder_name = parse_algorithm(algorithm) if algorithm is not None else (None, None)
    method_name = overrides.pop("method.name", method_name)
    coder_name = overrides.pop("coder.name", coder_name)
    if method_name is None:
        raise ValueError(f"give an algorithm or method.name; methods: {', '.join(METHODS)}")
    method_cls = _lookup(METHODS, "method", method_name, "default_config")
    coder_cls = _lookup(CODERS, "coder", coder_name or method_cls.default_coder, "default_config")
    base = ExperimentConfig(
        run=RunConfig(**method_cls.run_defaults),
        data=DataConfig(),
        method=method_cls(),
        coder=coder_cls(**_fresh_coder(method_cls, coder_cls)),
    )
    return base.override(overrides, source="default_config") if overrides else base


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
    """Loads ``experiments/presets/<name>.toml`` (``description`` and the four tables) into a checked
    :class:`ExperimentConfig` (see the module docstring for what a left-out field means)."""
    path, values = _read_preset(name)
    values.pop("description", None)
    return config_from_dict(values, source=str(path))


def preset_description(name: str) -> str:
    """The ``description`` line of a preset (every shipped preset has one)."""
    path, values = _read_preset(name)
    if not isinstance(values.get("description"), str) or not values["description"].strip():
        raise ValueError(f"{path}: the preset has no description")
    return values["description"]


def _toml_value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


#: ``[run]`` fields that differ between the processes of one run, or between a run and its resume: not part
#: of a preset, of the processes' configuration fingerprint, or of the check that a resume is the same run
LAUNCH_FIELDS = ("run.coordinator", "run.process_id")


def preset_toml(config: ExperimentConfig, description: str) -> str:
    """The TOML text of a preset that loads as ``config``: every field that is set, written out (unset
    fields have no TOML value and are left out), except the launch settings (:data:`LAUNCH_FIELDS`)."""
    lines = [f"description = {_toml_value(description)}"]
    for table, values in config.to_dict().items():
        lines += ["", f"[{table}]"]
        lines += [
            f"{k} = {_toml_value(v)}"
            for k, v in values.items()
            if v is not None and f"{table}.{k}" not in LAUNCH_FIELDS
        ]
    return "\n".join(lines) + "\n"


def field_docs() -> dict[str, str]:
    """One line of help per flag (``run.rounds``, ``method.client_lr``, ...): a field several methods or
    coders have is documented by the first that has it."""
    docs: dict[str, str] = {}
    for table, classes in (
        ("run", [RunConfig]),
        ("data", [DataConfig]),
        ("method", list(METHODS.values())),
        ("coder", list(CODERS.values())),
    ):
        for cls in classes:
            for name, doc in cls.field_docs().items():
                docs.setdefault(f"{table}.{name}", doc)
    return docs
