"""The federated round engine, local training and evaluation (the algorithms are in
:mod:`sidejax.algorithms`)."""

from sidejax.fl.base import (
    Algorithm,
    Batch,
    BroadcastFn,
    ClientData,
    ClientInfo,
    ClientUpdate,
    EmptyState,
    ReceiveFn,
    RoundInfo,
    RoundState,
    ServerUpdate,
    initial_round_state,
    no_metrics,
)
from sidejax.fl.evaluate import EvalResult, build_evaluator
from sidejax.fl.local import (
    LocalInfo,
    build_local_trainer,
    classification_loss,
    epoch_order,
    masked_mean,
    num_local_steps,
)
from sidejax.fl.rounds import (
    CLIENT_STRATEGIES,
    ClientMap,
    as_client_map,
    build_round_step,
    check_federation,
    default_client_strategy,
    run_rounds,
    sample_clients,
)

__all__ = [
    "Algorithm",
    "Batch",
    "BroadcastFn",
    "ClientData",
    "ClientInfo",
    "ClientUpdate",
    "EmptyState",
    "ReceiveFn",
    "no_metrics",
    "ClientMap",
    "as_client_map",
    "RoundInfo",
    "RoundState",
    "initial_round_state",
    "ServerUpdate",
    "EvalResult",
    "build_evaluator",
    "LocalInfo",
    "build_local_trainer",
    "classification_loss",
    "epoch_order",
    "masked_mean",
    "num_local_steps",
    "CLIENT_STRATEGIES",
    "build_round_step",
    "check_federation",
    "default_client_strategy",
    "run_rounds",
    "sample_clients",
]
