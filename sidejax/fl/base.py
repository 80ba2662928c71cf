"""Contracts of the round engine: states, infos, and the algorithm container.

An algorithm is a pair of pure functions (optax/blackjax style), held in :class:`Algorithm`:

- ``init(key, params, num_clients) -> RoundState``
- ``round_step(round_key, state, data) -> (RoundState, RoundInfo)``

``round_step`` is usually built by :func:`sidejax.fl.build_round_step` from three smaller pure functions,
one per role (see :class:`BroadcastFn`, :class:`ClientUpdate`, :class:`ServerUpdate`). States are carried by
``lax.scan``; infos are emitted, stacked over rounds, and never fed back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.coding.base import Message
from sidejax.keys import ClientKeys
from sidejax.types import Bits, Params, PRNGKey, PyTree

__all__ = [
    "EmptyState",
    "ClientData",
    "Batch",
    "ClientInfo",
    "RoundState",
    "initial_round_state",
    "RoundInfo",
    "BroadcastFn",
    "ClientUpdate",
    "ServerUpdate",
    "Algorithm",
]


class EmptyState(NamedTuple):
    """State of a stateless component (e.g. FedAvg clients)."""


class ClientData(NamedTuple):
    """One client's view of a :class:`sidejax.data.FederatedData`.

    The inputs are stored once for the whole federation; a client owns a padded row of indices into them.

    Attributes:
      x: all training inputs ``[num_examples_total, ...]`` (shared by every client, not vmapped).
      y: all training targets ``[num_examples_total]``.
      indices: int32 ``[max_examples]``: this client's example indices, padded.
      num_examples: int32 scalar: the number of valid entries at the front of ``indices``.
    """

    x: jax.Array
    y: jax.Array
    indices: jax.Array
    num_examples: jax.Array


class Batch(NamedTuple):
    """A minibatch with a validity mask (padding rows have ``mask == 0`` and must not count in a loss)."""

    x: jax.Array
    y: jax.Array
    mask: jax.Array


class ClientInfo(NamedTuple):
    """What every client reports about its local work (stacked over participants by the engine).

    Attributes:
      loss: float32 scalar, the mean training loss over the client's local steps.
      finite: bool scalar, False if any local loss or the client's result was NaN/inf.
      extra: algorithm-specific diagnostics (a pytree; ``()`` if none).
    """

    loss: jax.Array
    finite: jax.Array
    extra: PyTree = ()


class RoundState(NamedTuple):
    """The ``lax.scan`` carry.

    Attributes:
      round_index: int32 scalar, the index of the *next* round to run.
      server: algorithm-specific server state.
      clients: algorithm-specific client state, stacked over **all** clients (``EmptyState()`` if none).
      num_clients: int32 scalar, the federation size the state was initialised for (``init``'s
        ``num_clients``). :func:`sidejax.fl.run_rounds` refuses data with another number of clients. ``None``
        (the default, for hand-built states) skips that check.
    """

    round_index: jax.Array
    server: PyTree
    clients: PyTree
    num_clients: jax.Array | None = None


def initial_round_state(server: PyTree, clients: PyTree, num_clients: int) -> RoundState:
    """The :class:`RoundState` an ``init`` returns: round 0, recording ``num_clients``.

    Raises:
      ValueError: if ``num_clients`` is not an integer >= 1.
    """
    if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer) or num_clients < 1:
        raise ValueError(
            f"num_clients must be an integer >= 1 (the number of clients in the data), got {num_clients!r}"
        )
    return RoundState(jnp.int32(0), server, clients, jnp.int32(num_clients))


class RoundInfo(NamedTuple):
    """Diagnostics of one round (stacked over rounds by :func:`sidejax.fl.run_rounds`).

    Attributes:
      round_index: int32 scalar, the round these numbers belong to.
      client_ids: int32 ``[clients_per_round]``, the global ids of the participants, ascending.
      uplink_bits: float32 ``[clients_per_round]``, length of each participant's uplink message.
      downlink_bits: float32 ``[clients_per_round]``, length of the downlink message each participant
        received.
      clients: :class:`ClientInfo` stacked over participants.
      server: algorithm-specific server diagnostics.
      server_finite: bool scalar, False if the new server state holds a NaN/inf.
    """

    round_index: jax.Array
    client_ids: jax.Array
    uplink_bits: Bits
    downlink_bits: Bits
    clients: ClientInfo
    server: PyTree
    server_finite: jax.Array


class BroadcastFn(Protocol):
    """Builds what the participants receive at the start of a round, and its cost."""

    def __call__(self, downlink_key: PRNGKey, server: PyTree, client_ids: jax.Array) -> tuple[PyTree, Bits]:
        """Returns ``(broadcast, downlink_bits[clients])``; ``broadcast`` is what clients decode and use."""


class ClientUpdate(Protocol):
    """One client's local work for one round (vmapped or mapped over participants by the engine)."""

    def __call__(
        self, keys: ClientKeys, broadcast: PyTree, state: PyTree, data: ClientData
    ) -> tuple[PyTree, Message, ClientInfo]:
        """Returns ``(new_client_state, uplink_message, info)``."""


class ServerUpdate(Protocol):
    """The server's step: decode the stacked messages and update its state."""

    def __call__(
        self,
        round_key: PRNGKey,
        server: PyTree,
        client_ids: jax.Array,
        messages: Message,
        weights: jax.Array,
    ) -> tuple[PyTree, PyTree]:
        """``messages`` leaves have a leading participants axis; returns ``(server_state, server_info)``."""


class Algorithm(NamedTuple):
    """A federated algorithm: pure functions only, no hidden state.

    Attributes:
      init: ``init(key, params, num_clients) -> RoundState``.
      round_step: ``round_step(round_key, state, data) -> (RoundState, RoundInfo)``.
      eval_params: ``eval_params(server_state) -> Params``: the model parameters to evaluate (e.g. FedAvg's
        global weights; FedPM's masked network).
    """

    init: Callable[[PRNGKey, Params, int], RoundState]
    round_step: Callable[[PRNGKey, RoundState, Any], tuple[RoundState, RoundInfo]]
    eval_params: Callable[[PyTree], Params]
