"""Contracts of the round engine: states, infos, and the algorithm container.

An algorithm is a set of pure role kernels (optax/blackjax style), held in :class:`Algorithm`:

- ``init(key, params, num_clients) -> RoundState``;
- ``broadcast(downlink_key, server, client_ids) -> (server, Message)``: the downlink, shared or per
  participant, and the server's record of what it sent;
- ``receive(downlink_key, keys, server, client_state, message) -> received``: the client side of the downlink;
- ``client_update(keys, received, client_state, data) -> (client_state, Message, ClientInfo)``;
- ``server_update(round_key, server, client_ids, shared_keys, messages, weights)
  -> (server, server_info, uplink_errors)``;
- ``evaluation``: an :class:`Evaluation`, what the state is evaluated as (the global model, or an ensemble's
  samples, and a personalized method's personal models), and ``metrics``.

The engine (:func:`sidejax.fl.build_round_step`) composes them into one round and chooses how to map the
clients (:class:`sidejax.fl.ClientMap`, passed once). States are carried by ``lax.scan``; infos are emitted,
stacked over rounds, and never fed back. Every bit count in :class:`RoundInfo` is read from a message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.coding.base import EmptyState, Message
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
    "ReceiveFn",
    "ClientUpdate",
    "ServerUpdate",
    "Evaluation",
    "Algorithm",
    "no_metrics",
]


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
      valid: bool scalar, False if the coder reported an invalid input (``q`` or ``p`` not a valid
        distribution, a non-finite KL): the client's stream is then garbage.
      downlink_errors: int32 scalar, the error bitmask of the client's decoding of its downlink (0 = well
        formed, or a downlink that is not parsed as a stream; :func:`sidejax.coding.stream_errors`).
    """

    loss: jax.Array
    finite: jax.Array
    extra: PyTree = ()
    valid: jax.Array | bool = True
    downlink_errors: jax.Array | int = 0


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
      uplink_bits: int32 ``[clients_per_round]``, length of each participant's uplink message (exact).
      downlink_bits: int32 ``[clients_per_round]``, length of the downlink message each participant
        received (exact).
      clients: :class:`ClientInfo` stacked over participants.
      server: algorithm-specific server diagnostics.
      server_finite: bool scalar, False if the new server state holds a NaN/inf.
      uplink_errors: int32 ``[clients_per_round]``: the decoder's error bitmask of each participant's
        uplink stream (0 = well formed; :func:`sidejax.coding.stream_errors` gives the reasons). A nonzero
        entry means that client's decoded sample, and everything aggregated from it, is garbage.
      downlink_shared: bool scalar: the round's downlink was one message for every participant (a
        broadcast: on a broadcast channel it is sent once), not one per participant.
      included: bool ``[clients_per_round]``: the participants the server's aggregates counted. A
        participant is excluded when its client reported an invalid input or a non-finite result
        (``clients.valid`` or ``clients.finite`` False: its stream was withheld,
        :func:`sidejax.coding.withhold`) or its stream decoded invalid (``uplink_errors != 0``); the
        aggregates are renormalised over the included ones, and with none included the server kept its
        previous state.
    """

    round_index: jax.Array
    client_ids: jax.Array
    uplink_bits: Bits
    downlink_bits: Bits
    clients: ClientInfo
    server: PyTree
    server_finite: jax.Array
    uplink_errors: jax.Array
    downlink_shared: jax.Array | bool = False
    included: jax.Array | None = None


class BroadcastFn(Protocol):
    """The server's downlink at the start of a round: a :class:`sidejax.coding.Message`, and the server
    state updated with what the server knows once it has sent it (BICompFL-PR: its copy of every
    recipient's estimate, decoded from the message it sent; most algorithms return ``server`` unchanged)."""

    def __call__(
        self, downlink_key: PRNGKey, server: PyTree, client_ids: jax.Array
    ) -> tuple[PyTree, Message]:
        """Returns ``(server, message)``: with a scalar ``num_bits`` one message shared by every participant
        (a broadcast), with ``num_bits`` of shape ``[clients]`` (and payload leaves with a leading
        participants axis) one message per participant. The returned server state is what
        ``server_update`` sees."""


class ReceiveFn(Protocol):
    """The client-side step that decodes the downlink into what the client works with."""

    def __call__(
        self, downlink_key: PRNGKey, keys: ClientKeys, server: PyTree, client_state: PyTree, message: Message
    ) -> PyTree:
        """``server`` (the state *before* this round's broadcast) stands for what every receiver already
        knows (seeds, shapes, earlier rounds' protocol state); ``client_state`` is this client's own memory
        (e.g. its own copy of the global model, the prior it decodes against). Every field the message
        carries must be taken from the decoded message."""


class ClientUpdate(Protocol):
    """One client's local work for one round (vmapped or mapped over participants by the engine)."""

    def __call__(
        self, keys: ClientKeys, received: PyTree, state: PyTree, data: ClientData
    ) -> tuple[PyTree, Message, ClientInfo]:
        """Returns ``(new_client_state, uplink_message, info)``."""


class ServerUpdate(Protocol):
    """The server's step: decode the stacked messages and update its state."""

    def __call__(
        self,
        round_key: PRNGKey,
        server: PyTree,
        client_ids: jax.Array,
        shared_keys: PRNGKey,
        messages: Message,
        weights: jax.Array,
    ) -> tuple[PyTree, PyTree, jax.Array]:
        """``shared_keys`` ``[clients]`` are the participants' shared keys (from the engine: the server never
        re-derives the key schedule); ``messages`` leaves have a leading participants axis; ``weights``
        ``[clients]`` the participants' example counts (``None``: equal). Returns
        ``(server_state, server_info, uplink_errors[clients])``.

        The aggregation contract: participant ``i`` counts iff :func:`sidejax.coding.included` (its stream
        was not withheld, and it decodes valid: ``uplink_errors[i] == 0``). Every aggregate, the coder's
        protocol step included (``coder.update`` sees the excluded entries as ``valid`` False), is taken
        over the included participants with their weights renormalised (:func:`sidejax.utils.masked_mean`);
        with none included the server keeps its previous state (:func:`sidejax.utils.keep_unless_none`)."""


def no_metrics(info: RoundInfo) -> dict:
    """The default metrics hook: nothing beyond the engine's own columns."""
    del info
    return {}


class Evaluation(NamedTuple):
    """What an algorithm's state is evaluated as: the one evaluation contract of every algorithm
    (:func:`sidejax.fl.build_algorithm_evaluator` builds its evaluator).

    Three shapes, all from this one value:

    - one global model: ``Evaluation(params)``, scored on a common test set;
    - an ensemble: ``Evaluation(params, ensemble=True)``: ``params(state)``'s leaves have a leading axis of
      ``S`` posterior samples / ensemble members, scored by their predictive average
      ``p̄ = (1/S) Σ_s softmax(f(x, θ_s))`` (docs/papers/bpcfl.md#a5; BPC-FL);
    - with personal models: ``personal`` set (either of the above for the global model): client ``c``'s own
      model, scored on client ``c``'s own test set, the clients pooled by example count
      (docs/papers/coreset_pfedbayes.md#s2-6; the pFedBayes family).

    Attributes:
      params: ``params(state: RoundState) -> Params``: the global model (with ``ensemble``, the stacked
        samples).
      ensemble: whether ``params`` has the leading sample axis (static).
      personal: ``None``, or ``personal(state: RoundState) -> Params`` with a leading axis over **all**
        clients (client ``c``'s personal model, e.g. pFedBayes' personal posterior mean).
    """

    params: Callable[[RoundState], Params]
    ensemble: bool = False
    personal: Callable[[RoundState], Params] | None = None


class Algorithm(NamedTuple):
    """A federated algorithm: pure functions only, no hidden state (the round engine,
    :func:`sidejax.fl.build_round_step`, composes them).

    Attributes:
      init: ``init(key, params, num_clients) -> RoundState``.
      broadcast: :class:`BroadcastFn`.
      receive: :class:`ReceiveFn`.
      client_update: :class:`ClientUpdate`.
      server_update: :class:`ServerUpdate`.
      evaluation: :class:`Evaluation`: the model(s) to evaluate and how (one model, an ensemble's samples,
        personal models); :attr:`eval_params` is its ``params``.
      clients_per_round: participants per round (static; the algorithm's math may depend on it).
      metrics: ``metrics(info: RoundInfo) -> dict[str, array]``: the algorithm's own diagnostics, one value
        per round (leading rounds axis when ``info`` is stacked), logged generically by drivers.
      track_server: what a client that runs in its own process (a deployment: :mod:`sidejax.flower`) knows of
        the server state, the ``server`` argument of :class:`ReceiveFn`. In one program the engine hands every
        receiver the server state itself; apart, each client keeps a *view* of it, starting from ``init``'s
        server state (both ends compute it from the run's seed), and after every round sets ``view =
        track_server(view, received, round_index, round_key, client_ids)``: the round's index, key and
        participants, and what the client's ``receive`` returned (``None`` when the downlink was one message
        per participant and it was not one of them). ``None``, the default: ``received`` when it has the
        server state's structure (the algorithm's ``receive`` returns its reading of the server state), else
        the view is kept (``receive`` reads only shapes and seeds from it). :func:`sidejax.fl.track_view`
        applies it; ``tests/fl/test_roles.py`` checks, for every algorithm, that the clients send the
        engine's messages from their views.
    """

    init: Callable[[PRNGKey, Params, int], RoundState]
    broadcast: BroadcastFn
    receive: ReceiveFn
    client_update: ClientUpdate
    server_update: ServerUpdate
    evaluation: Evaluation
    clients_per_round: int
    metrics: Callable[[RoundInfo], dict] = no_metrics
    track_server: Callable | None = None

    @property
    def eval_params(self) -> Callable[[RoundState], Params]:
        """``eval_params(state) -> Params``: the global model (``evaluation.params``; with
        ``evaluation.ensemble`` a leading sample axis)."""
        return self.evaluation.params
