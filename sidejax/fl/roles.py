"""The round engine's parties apart: the server's opening and closing of a round, one client's step, and a
client's view of the server state, each a jitted function of explicit values.

:func:`sidejax.fl.run_rounds` runs a whole federation in one program. A deployment runs the server and every
client in processes of their own (:mod:`sidejax.flower`), exchanging only the messages' bytes; these are the
same steps, cut where the messages cross:

- :func:`server_open`: the round's participants and downlink (:func:`sidejax.fl.rounds.open_downlink`);
- :func:`client_step`: one participant decodes its downlink and runs ``client_update`` with the keys of its
  global id (:func:`sidejax.keys.client_keys`), the same derivation as in one program, so both ends hold
  the same shared randomness;
- :func:`server_close`: ``server_update`` on the participants' messages, with the round's
  :class:`sidejax.fl.RoundInfo` (:func:`sidejax.fl.rounds.close_round`, the engine's own step 4);
- :func:`client_listen`: a client that does not take part in a round but hears its shared downlink keeps its
  view current (protocol state sent as changes, such as a KLMS partition update).

Every party derives everything else from the run's base key, the round index and the client id, as the engine
does. What a client cannot compute is the server state: the engine hands ``receive`` the server state itself
("what every receiver already knows"); apart, a client holds its *view* of it, which starts as ``init``'s
server state (the same at both ends: same seed, same initial parameters) and follows the downlinks the
client receives (:func:`track_view`, from :attr:`sidejax.fl.Algorithm.track_server`). That the messages sent
from the view are the engine's, bit for bit, is a property of each algorithm, checked for every family in
``tests/fl/test_roles.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sidejax.fl.base import Algorithm, ClientData
from sidejax.fl.rounds import ClientPhase, close_round, draw_participants, open_downlink
from sidejax.keys import DOWNLINK, client_keys, round_key, stream_key
from sidejax.types import PRNGKey, PyTree

__all__ = [
    "round_participants",
    "track_view",
    "track_rounds",
    "initial_parties",
    "server_open",
    "client_step",
    "client_listen",
    "client_skip",
    "server_close",
]


def round_participants(algorithm: Algorithm, base_key: PRNGKey, round_index, num_clients: int) -> jax.Array:
    """The participants of round ``round_index``: what every party computes from the run's key (the
    engine's sampling, :func:`sidejax.fl.sample_clients`), so no one needs to be told."""
    return draw_participants(algorithm, round_key(base_key, round_index), num_clients)


def _same_structure(a: PyTree, b: PyTree) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def track_view(
    algorithm: Algorithm, view: PyTree, received: PyTree, round_index, rkey: PRNGKey, client_ids
) -> PyTree:
    """A client's view of the server state after round ``round_index`` (key ``rkey``, participants
    ``client_ids``), in which it received ``received`` (``None``: it received nothing, the downlink being
    one message per participant): :attr:`sidejax.fl.Algorithm.track_server`, by default ``received`` where
    it has the server state's structure, else ``view`` unchanged."""
    if algorithm.track_server is not None:
        return algorithm.track_server(view, received, round_index, rkey, client_ids)
    return received if received is not None and _same_structure(received, view) else view


def track_rounds(view: PyTree, received: PyTree, round_index, rkey: PRNGKey, client_ids) -> PyTree:
    """:attr:`sidejax.fl.Algorithm.track_server` of a method whose ``receive`` reads only the shapes and a
    public count of completed rounds (the server state's ``rounds`` field: CSER's resets, LIEC's averagings,
    M3's sync coins) from the server state: the view counts the rounds run."""
    del received, rkey, client_ids
    return view._replace(rounds=jnp.asarray(round_index + 1, jnp.result_type(view.rounds)))


def initial_parties(
    algorithm: Algorithm, init_key: PRNGKey, params: PyTree, num_clients: int, client_id=None
):
    """The state each party starts from, computed alike at both ends: ``algorithm.init(init_key, params,
    num_clients)``'s server state (the server's state, and every client's first view of it) and, for
    ``client_id``, that client's row of the client state (``None``: every row). Returns ``(server,
    client_state)``."""
    state = algorithm.init(init_key, params, num_clients)
    clients = state.clients
    if client_id is not None:
        clients = jax.tree.map(lambda a: a[client_id], clients)
    return state.server, clients


@functools.partial(jax.jit, static_argnames=("algorithm", "num_clients"))
def server_open(algorithm: Algorithm, base_key: PRNGKey, round_index, server: PyTree, num_clients: int):
    """The server opens round ``round_index``: ``(client_ids, sent_server, downlink)``, the participants
    (ascending global ids), the server state after its broadcast (what :func:`server_close` takes) and the
    downlink :class:`sidejax.coding.Message` (one shared, or one per participant: ``num_bits[C]``)."""
    return open_downlink(algorithm, round_key(base_key, round_index), server, num_clients)


def _receive(algorithm, base_key, round_index, client_id, view, client_state, downlink):
    rkey = round_key(base_key, round_index)
    keys = client_keys(rkey, client_id)
    received = algorithm.receive(stream_key(rkey, DOWNLINK), keys, view, client_state, downlink)
    return rkey, keys, received


@functools.partial(jax.jit, static_argnames=("algorithm", "num_clients"))
def client_step(
    algorithm: Algorithm,
    base_key: PRNGKey,
    round_index,
    client_id,
    view: PyTree,
    client_state: PyTree,
    downlink,
    data: ClientData,
    num_clients: int,
):
    """Participant ``client_id``'s part of round ``round_index``: decode ``downlink`` (its own message when
    the downlink is per participant) against its ``view`` of the server state and its ``client_state``, then
    ``client_update`` on its own ``data``, with the keys of its global id.

    Returns:
      ``(client_state, message, info, view)``: the new client state, the uplink message (to be withheld by
      the transport when ``info.valid`` or ``info.finite`` is False, as the engine does), the
      :class:`sidejax.fl.ClientInfo` and the view for the next round.
    """
    rkey, keys, received = _receive(algorithm, base_key, round_index, client_id, view, client_state, downlink)
    new_state, message, info = algorithm.client_update(keys, received, client_state, data)
    ids = round_participants(algorithm, base_key, round_index, num_clients)
    return new_state, message, info, track_view(algorithm, view, received, round_index, rkey, ids)


@functools.partial(jax.jit, static_argnames=("algorithm", "num_clients"))
def client_listen(
    algorithm: Algorithm, base_key: PRNGKey, round_index, client_id, view, client_state, downlink, num_clients
):
    """The view of a client that is not a participant of round ``round_index`` after it decoded the round's
    shared ``downlink`` (its state is unchanged: only participants run ``client_update``)."""
    rkey, _, received = _receive(algorithm, base_key, round_index, client_id, view, client_state, downlink)
    ids = round_participants(algorithm, base_key, round_index, num_clients)
    return track_view(algorithm, view, received, round_index, rkey, ids)


@functools.partial(jax.jit, static_argnames=("algorithm", "num_clients"))
def client_skip(algorithm: Algorithm, base_key: PRNGKey, round_index, view, num_clients):
    """The view of a client that received nothing in round ``round_index`` (a per-participant downlink of
    which it is not a recipient): what the round's index and participants alone tell
    (:func:`track_view` with ``received=None``)."""
    rkey = round_key(base_key, round_index)
    ids = round_participants(algorithm, base_key, round_index, num_clients)
    return track_view(algorithm, view, None, round_index, rkey, ids)


@functools.partial(jax.jit, static_argnames=("algorithm",))
def server_close(
    algorithm: Algorithm,
    base_key: PRNGKey,
    round_index,
    sent_server: PyTree,
    client_ids,
    downlink,
    messages,
    client_info,
    counts,
):
    """The server closes round ``round_index`` from the participants' stacked ``messages`` (in
    ``client_ids`` order), their :class:`sidejax.fl.ClientInfo` and example ``counts``: the engine's step 4
    (:func:`sidejax.fl.rounds.close_round`), with the participants' shared keys derived here. Returns
    ``(server, info)``."""
    rkey = round_key(base_key, round_index)
    keys = jax.vmap(client_keys, (None, 0))(rkey, client_ids)
    phase = ClientPhase(client_ids, keys, sent_server, downlink, messages, None, client_info, counts)
    return close_round(algorithm, rkey, round_index, phase)
