"""Builds a :class:`sidejax.fl.Algorithm` from an :class:`ExperimentConfig`: the method's config builds the
algorithm (:meth:`experiments.methods.MethodConfig.build`) with the coder its coder config builds
(:meth:`experiments.coders.CoderConfig.build`); the client map is the engine's (:func:`client_map`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from experiments.config import ExperimentConfig, default_config
from experiments.methods import OPTIMIZERS, SHORTCUTS, Build, make_optimizer
from sidejax.coding import KLMSConfig
from sidejax.fl import Algorithm, ClientMap, default_client_strategy, mesh_client_map

__all__ = [
    "ALGORITHMS",
    "KLMS_HOSTS",
    "OPTIMIZERS",
    "default_config",
    "make_optimizer",
    "klms_config",
    "resolve_client_strategy",
    "client_map",
    "build_algorithm",
]

#: the algorithm names (shortcuts) and their (method, coder) pairs
ALGORITHMS: dict[str, tuple[str, str]] = SHORTCUTS

#: the uncompressed host method of each KLMS variant (for compression factors in results tables)
KLMS_HOSTS = {"fedpm_klms": "fedpm", "qsgd_klms": "qsgd", "signsgd_klms": "signsgd", "sgld_klms": "qlsd"}


def resolve_client_strategy(config: ExperimentConfig) -> str:
    """The strategy a run of ``config`` uses: the forced one, or for ``auto`` the library's backend default
    (:func:`sidejax.fl.default_client_strategy`)."""
    strategy = config.run.client_strategy
    return default_client_strategy() if strategy == "auto" else strategy


def client_map(config: ExperimentConfig) -> ClientMap:
    """The engine's client map for a run of ``config`` (passed once, to :func:`sidejax.fl.run_rounds`):
    on one device, or with ``run.devices = N > 1`` split over a mesh of the first ``N`` devices
    (:func:`sidejax.fl.mesh_client_map`)."""
    strategy = resolve_client_strategy(config)
    if config.run.devices == 1:
        return ClientMap(strategy)
    return mesh_client_map(config.run.devices, strategy=strategy)


def klms_config(config: ExperimentConfig, **overrides) -> KLMSConfig:
    """The :class:`sidejax.coding.KLMSConfig` a KLMS run of ``config`` uses (``overrides``: other fields)."""
    if config.coder.name != "klms":
        raise ValueError(
            f"{config.algorithm} does not use the KLMS coder (its coder is {config.coder.name!r})"
        )
    values = {"bucket_update_rounds": resolve_client_strategy(config) == "map", **overrides}
    return config.coder.klms_config(**values)


class ModelContext(NamedTuple):
    """What a method that trains from the network's initialisation needs besides the loss (BPC-FL's shared
    expert initialisations and pseudo-input shapes): ``init_fn(key) -> params``, one example's
    ``input_shape`` and ``num_classes``."""

    init_fn: Callable
    input_shape: tuple[int, ...]
    num_classes: int


def build_algorithm(
    config: ExperimentConfig, loss_fn: Callable, model: ModelContext | None = None
) -> Algorithm:
    """The algorithm of ``config``'s method, sending its messages with ``config``'s coder; a method with
    ``needs_model`` (BPC-FL) also gets ``model``."""
    coder = config.coder.checked(config.method, client_strategy=resolve_client_strategy(config))
    return config.method.build(
        Build(
            loss_fn,
            coder,
            num_clients=config.data.num_clients,
            clients_per_round=config.clients_per_round,
            coder_config=config.coder,
            model=model if config.method.needs_model else None,
        )
    )
