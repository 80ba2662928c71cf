"""Builds a :class:`sidejax.fl.Algorithm` from an :class:`ExperimentConfig` (one builder per algorithm)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from experiments.config import ExperimentConfig, config_from_dict
from sidejax.algorithms import LangevinSettings, fedavg, fedpm, qlsd, qsgd, sgld, signsgd
from sidejax.coding import KLMSConfig, elias_coder, klms_coder, mask_coder
from sidejax.fl import Algorithm, ClientMap, LocalTraining, default_client_strategy

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_DEFAULTS",
    "KLMS_HOSTS",
    "default_config",
    "make_optimizer",
    "klms_config",
    "client_map",
    "build_algorithm",
]

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


def _client_strategy(config: ExperimentConfig) -> str | None:
    """``None`` (the library's backend default) for ``auto``, else the strategy the config forces."""
    return None if config.client_strategy == "auto" else config.client_strategy


def resolve_client_strategy(config: ExperimentConfig) -> str:
    """The strategy a run of ``config`` uses: the forced one, or for ``auto`` the library's backend default
    (:func:`sidejax.fl.default_client_strategy`)."""
    return _client_strategy(config) or default_client_strategy()


def client_map(config: ExperimentConfig) -> ClientMap:
    """The engine's client map for a run of ``config`` (passed once, to :func:`sidejax.fl.run_rounds`)."""
    return ClientMap(resolve_client_strategy(config))


def _fedavg(config: ExperimentConfig, loss_fn: Callable) -> Algorithm:
    server = None
    if config.server_optimizer != "none":
        server = make_optimizer(config.server_optimizer, config.server_lr)
    return fedavg(
        loss_fn,
        _local(config),
        clients_per_round=config.clients_per_round,
        server_optimizer=server,
    )


def klms_config(config: ExperimentConfig, **overrides) -> KLMSConfig:
    """The :class:`sidejax.coding.KLMSConfig` described by the config's KLMS fields."""
    values = dict(
        log2_num_candidates=config.log2_candidates,
        overhead_bits=config.klms_overhead_bits,
        adaptive=config.klms_adaptive,
        block_size=config.block_size,
        max_block_size=config.max_block_size,
        trigger=config.klms_trigger,
        dbar_min=config.klms_dbar_min or None,
        dbar_max=config.klms_dbar_max or None,
        # each client's own bucket only pays off when clients run one after another (under vmap every
        # bucket's branch would run for the batch)
        bucket_update_rounds=resolve_client_strategy(config) == "map",
    )
    values.update(overrides)
    return KLMSConfig(**values)


def _local(config: ExperimentConfig) -> LocalTraining:
    return LocalTraining(
        make_optimizer(config.client_optimizer, config.client_lr),
        batch_size=config.batch_size,
        num_epochs=config.local_epochs,
    )


def _common(config: ExperimentConfig) -> dict:
    return dict(clients_per_round=config.clients_per_round)


def _fedpm(config: ExperimentConfig, loss_fn: Callable, coder) -> Algorithm:
    return fedpm(
        loss_fn,
        _local(config),
        coder=coder,
        estimator=config.fedpm_estimator,
        **_common(config),
    )


def _qsgd(config: ExperimentConfig, loss_fn: Callable, coder, levels: int) -> Algorithm:
    return qsgd(
        loss_fn,
        _local(config),
        server_lr=config.server_lr,
        levels=levels,
        coder=coder,
        **_common(config),
    )


def _signsgd(config: ExperimentConfig, loss_fn: Callable, coder) -> Algorithm:
    return signsgd(
        loss_fn,
        _local(config),
        server_lr=config.server_lr,
        temperature=config.sign_temperature,
        coder=coder,
        **_common(config),
    )


def _langevin(config: ExperimentConfig) -> dict:
    return dict(
        num_clients=config.num_clients,
        clients_per_round=config.clients_per_round,
        settings=LangevinSettings(config.batch_size, config.sgld_step_size, config.prior_weight_decay),
    )


def _klms(config: ExperimentConfig):
    return klms_coder(klms_config(config))


ALGORITHMS: dict[str, Callable[[ExperimentConfig, Callable], Algorithm]] = {
    "fedavg": _fedavg,
    "fedpm": lambda c, f: _fedpm(c, f, mask_coder()),
    "fedpm_klms": lambda c, f: _fedpm(c, f, _klms(c)),
    "qsgd": lambda c, f: _qsgd(c, f, elias_coder(c.qsgd_levels), c.qsgd_levels),
    "qsgd_klms": lambda c, f: _qsgd(c, f, _klms(c), 1),
    "signsgd": lambda c, f: _signsgd(c, f, None),
    "signsgd_klms": lambda c, f: _signsgd(c, f, _klms(c)),
    "qlsd": lambda c, f: qlsd(f, levels=c.qsgd_levels, coder=elias_coder(c.qsgd_levels), **_langevin(c)),
    "sgld_klms": lambda c, f: sgld(f, coder=_klms(c), **_langevin(c)),
}

#: the uncompressed host method of each KLMS variant (for compression factors in results tables)
KLMS_HOSTS = {"fedpm_klms": "fedpm", "qsgd_klms": "qsgd", "signsgd_klms": "signsgd", "sgld_klms": "qlsd"}


# The reduced-scale Fashion-MNIST presets' tuned values (experiments/presets/klms_fmnist_*.toml).
# KLMS: K = 256 candidates, blocks of 5 bits of KL (r = 3), cap 1024, re-partition outside [3.33, 10] bits
_KLMS_TUNED = {
    "log2_candidates": 8,
    "klms_overhead_bits": 3.0,
    "max_block_size": 1024,
    "klms_dbar_min": 3.33,
    "klms_dbar_max": 10.0,
}
_DENSE = {"client_optimizer": "momentum", "client_lr": 0.05}  # SGD + momentum 0.9, lr 0.05
_MASK = {"client_optimizer": "adam", "client_lr": 0.1}  # Adam 0.1 on FedPM's mask scores
# Langevin (reference code's MNIST values): one minibatch of 64 per round, gamma 1e-5, 200 rounds. The
# potential sums over the client's data, so the effective step grows with the dataset: on the 1,437-example
# digits gamma 1e-5 is slow (about 60-66% after 200 rounds); demo_digits_{qlsd,sgld_klms} use 1e-4.
_LANGEVIN = {
    "batch_size": 64,
    "sgld_step_size": 1e-5,
    "prior_weight_decay": 5.0,
    "qsgd_levels": 5,
    "rounds": 200,
    "eval_every": 20,
}

#: Per-algorithm defaults of the command line: applied to the fields that neither a preset nor a flag sets
#: (the tuned values of the ``klms_fmnist_*`` / ``fedavg_fmnist_*`` presets). With ExperimentConfig's plain
#: defaults some methods barely learn (5 rounds on digits: SignSGD 7.8%, QSGD-KLMS 9.7%).
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "fedavg": dict(_DENSE),
    "fedpm": dict(_MASK),
    "fedpm_klms": {**_MASK, **_KLMS_TUNED},
    "qsgd": {**_DENSE, "server_lr": 1.0},
    "qsgd_klms": {**_DENSE, "server_lr": 1.0, **_KLMS_TUNED},
    "signsgd": {**_DENSE, "server_lr": 0.02},
    "signsgd_klms": {**_DENSE, "server_lr": 0.02, **_KLMS_TUNED},
    "qlsd": dict(_LANGEVIN),
    "sgld_klms": {**_LANGEVIN, "max_block_size": 16, "log2_candidates": 2},
}


def default_config(algorithm: str, **overrides: Any) -> ExperimentConfig:
    """The command line's configuration for ``algorithm`` without a preset: :class:`ExperimentConfig`'s
    defaults, then :data:`ALGORITHM_DEFAULTS` for the algorithm, then ``overrides``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid algorithms: {sorted(ALGORITHMS)}")
    return config_from_dict({**ALGORITHM_DEFAULTS[algorithm], **overrides, "algorithm": algorithm})


def build_algorithm(config: ExperimentConfig, loss_fn: Callable) -> Algorithm:
    """Looks up ``config.algorithm`` and builds it."""
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {config.algorithm!r}; valid algorithms: {sorted(ALGORITHMS)}")
    return ALGORITHMS[config.algorithm](config, loss_fn)
