"""Builds a :class:`sidejax.fl.Algorithm` from an :class:`ExperimentConfig` (one builder per algorithm)."""

from __future__ import annotations

from collections.abc import Callable

import optax

from experiments.config import ExperimentConfig
from sidejax.algorithms import fedpm, langevin, qsgd, signsgd
from sidejax.fl import Algorithm, fedavg
from sidejax.klms import KLMSConfig

__all__ = ["ALGORITHMS", "KLMS_HOSTS", "make_optimizer", "klms_config", "build_algorithm"]

OPTIMIZERS = ("sgd", "momentum", "adam")


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """``sgd``, ``momentum`` (0.9) or ``adam``."""
    if name == "sgd":
        return optax.sgd(lr)
    if name == "momentum":
        return optax.sgd(lr, momentum=0.9)
    if name == "adam":
        return optax.adam(lr)
    raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {list(OPTIMIZERS)}")


def _fedavg(config: ExperimentConfig, loss_fn: Callable) -> Algorithm:
    server = None
    if config.server_optimizer != "none":
        server = make_optimizer(config.server_optimizer, config.server_lr)
    return fedavg(
        loss_fn,
        make_optimizer(config.client_optimizer, config.client_lr),
        clients_per_round=config.clients_per_round,
        batch_size=config.batch_size,
        local_epochs=config.local_epochs,
        server_optimizer=server,
        client_strategy=config.client_strategy,
    )


def klms_config(config: ExperimentConfig, **overrides) -> KLMSConfig:
    """The :class:`sidejax.klms.KLMSConfig` described by the config's KLMS fields."""
    values = dict(
        log2_num_candidates=config.log2_candidates,
        overhead_bits=config.klms_overhead_bits,
        adaptive=config.klms_adaptive,
        block_size=config.block_size,
        max_block_size=config.max_block_size,
        trigger=config.klms_trigger,
        dbar_min=config.klms_dbar_min or None,
        dbar_max=config.klms_dbar_max or None,
    )
    values.update(overrides)
    return KLMSConfig(**values)


def _common(config: ExperimentConfig) -> dict:
    return dict(
        clients_per_round=config.clients_per_round,
        batch_size=config.batch_size,
        local_epochs=config.local_epochs,
        client_strategy=config.client_strategy,
    )


def _fedpm(config: ExperimentConfig, loss_fn: Callable, use_klms: bool) -> Algorithm:
    return fedpm(
        loss_fn,
        make_optimizer(config.client_optimizer, config.client_lr),
        klms=klms_config(config) if use_klms else None,
        estimator=config.fedpm_estimator,
        **_common(config),
    )


def _qsgd(config: ExperimentConfig, loss_fn: Callable, use_klms: bool) -> Algorithm:
    return qsgd(
        loss_fn,
        make_optimizer(config.client_optimizer, config.client_lr),
        server_lr=config.server_lr,
        levels=1 if use_klms else config.qsgd_levels,
        klms=klms_config(config) if use_klms else None,
        paper_compat=config.paper_compat,
        **_common(config),
    )


def _signsgd(config: ExperimentConfig, loss_fn: Callable, use_klms: bool) -> Algorithm:
    return signsgd(
        loss_fn,
        make_optimizer(config.client_optimizer, config.client_lr),
        server_lr=config.server_lr,
        temperature=config.sign_temperature,
        klms=klms_config(config) if use_klms else None,
        **_common(config),
    )


def _langevin(config: ExperimentConfig, loss_fn: Callable, use_klms: bool) -> Algorithm:
    return langevin(
        loss_fn,
        num_clients=config.num_clients,
        clients_per_round=config.clients_per_round,
        batch_size=config.batch_size,
        step_size=config.sgld_step_size,
        weight_decay=config.prior_weight_decay,
        levels=config.qsgd_levels,
        klms=klms_config(config) if use_klms else None,
        paper_compat=config.paper_compat,
        client_strategy=config.client_strategy,
    )


ALGORITHMS: dict[str, Callable[[ExperimentConfig, Callable], Algorithm]] = {
    "fedavg": _fedavg,
    "fedpm": lambda c, f: _fedpm(c, f, False),
    "fedpm_klms": lambda c, f: _fedpm(c, f, True),
    "qsgd": lambda c, f: _qsgd(c, f, False),
    "qsgd_klms": lambda c, f: _qsgd(c, f, True),
    "signsgd": lambda c, f: _signsgd(c, f, False),
    "signsgd_klms": lambda c, f: _signsgd(c, f, True),
    "qlsd": lambda c, f: _langevin(c, f, False),
    "sgld_klms": lambda c, f: _langevin(c, f, True),
}

#: the uncompressed host method of each KLMS variant (for compression factors in results tables)
KLMS_HOSTS = {"fedpm_klms": "fedpm", "qsgd_klms": "qsgd", "signsgd_klms": "signsgd", "sgld_klms": "qlsd"}


def build_algorithm(config: ExperimentConfig, loss_fn: Callable) -> Algorithm:
    """Looks up ``config.algorithm`` and builds it."""
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {config.algorithm!r}; valid algorithms: {sorted(ALGORITHMS)}")
    return ALGORITHMS[config.algorithm](config, loss_fn)
