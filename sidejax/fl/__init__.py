"""The federated round engine, local training, evaluation, and FedAvg."""

from sidejax.fl.base import (
    Algorithm,
    Batch,
    BroadcastFn,
    ClientData,
    ClientInfo,
    ClientUpdate,
    EmptyState,
    RoundInfo,
    RoundState,
    ServerUpdate,
    initial_round_state,
)
from sidejax.fl.evaluate import EvalResult, build_evaluator
from sidejax.fl.fedavg import FedAvgServerInfo, FedAvgState, fedavg, weighted_mean
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
    "RoundInfo",
    "RoundState",
    "initial_round_state",
    "ServerUpdate",
    "EvalResult",
    "build_evaluator",
    "FedAvgServerInfo",
    "FedAvgState",
    "fedavg",
    "weighted_mean",
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
