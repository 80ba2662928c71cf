"""Flower apps around :class:`sidejax.flower.ServerParty` and :class:`sidejax.flower.ClientParty` (Flower 1.x
Message API: ``ServerApp`` / ``ClientApp``, run by a SuperLink and SuperNodes, or by Flower's simulation
runtime). Needs the optional extra: ``pip install "sidejax[flower]"``.

A run is described by one function, ``build(run_config, node_config) -> Federation``, called in every process
(server and clients) from Flower's run configuration: it names the algorithm, the keys, the initial
parameters and how a client loads its own examples. Both ends build the same :class:`Federation`, so the
configuration fingerprint in every envelope matches; a SuperNode started for another configuration or seed is
refused at the handshake, before the first round.

The server's loop (:func:`server_app`):

1. waits for ``num_clients`` SuperNodes (``connect_timeout``) and asks each for its client id (its
   ``partition-id`` node configuration) and fingerprint (message type ``query``);
2. each round: :meth:`ServerParty.open_round`, then one ``train`` message per SuperNode: participants get
   their downlink envelope, the other clients the shared downlink to keep their view of the server state
   current (:func:`sidejax.fl.roles.client_listen`); participants answer with their uplink envelope, their
   :class:`sidejax.fl.ClientInfo` and example count, listeners with an empty acknowledgement;
3. :meth:`ServerParty.close_round` on the replies that arrived within ``round_timeout``: a SuperNode that
   died is a missing participant (excluded, like a withheld stream) as long as ``min_replies`` remain, else
   the run stops with :class:`sidejax.flower.RoundFailedError`; a client that answers with an error (another
   configuration, a corrupted downlink) stops the run with that error.

Payloads are bytes fields of a ``ConfigRecord`` named ``"sidejax"``: ``envelope`` (the coded message, see
:mod:`sidejax.flower.envelope`), ``info`` and ``state`` (a client's diagnostics and, in ``Context.state``,
what it keeps between rounds). :func:`flower_message_bytes` is the size Flower's own serialisation gives a
message, for the byte tables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from sidejax.flower.envelope import config_fingerprint
from sidejax.flower.party import ClientParty, Reply, RoundFailedError, RoundReport, ServerParty

try:
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        'sidejax.flower.apps needs Flower: pip install "sidejax[flower]" (flwr >= 1.20, the Message API)'
    ) from exc

__all__ = [
    "Federation",
    "flip_mod",
    "FLIP_ENV",
    "server_app",
    "client_app",
    "flower_message_bytes",
    "RECORD",
]

RECORD = "sidejax"
#: Flower error codes that mean a reply will not come (the SuperNode or its ClientApp is gone): the
#: participant is missing, and the round goes on if ``min_replies`` remain. Any other error (the ClientApp
#: raised, e.g. refusing another configuration) stops the run with the client's reason.
_LOST = (3, 4, 5, 8)  # MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE, CLIENT_APP_CRASHED
#: The fault tests' hook: ``SIDEJAX_FLOWER_FLIP="R:C"`` in a SuperNode's environment flips a byte of client
#: ``C``'s uplink stream of round ``R`` on its way out (:func:`flip_mod`), standing for corruption in transit.
FLIP_ENV = "SIDEJAX_FLOWER_FLIP"


class Federation(NamedTuple):
    """One run, as every process builds it from the run configuration.

    Attributes:
      algorithm: the :class:`sidejax.fl.Algorithm`.
      init_key, base_key: :func:`sidejax.keys.run_keys` of the run's seed.
      params: the initial model parameters (from ``init_key``).
      num_clients: clients in the federation (one SuperNode each).
      num_rounds: rounds to run.
      config: the run's configuration (JSON-able; its :func:`sidejax.flower.config_fingerprint` is in every
        envelope).
      partition: ``partition(client_id) -> ClientData``: a client's own examples
        (:func:`sidejax.flower.own_partition`); only the server calls it with ``0``, for the shapes.
      min_replies: the fewest participants' replies a round is aggregated from.
      round_timeout: seconds the server waits for a round's replies.
      connect_timeout: seconds the server waits for the SuperNodes at the start.
    """

    algorithm: Any
    init_key: Any
    base_key: Any
    params: Any
    num_clients: int
    num_rounds: int
    config: Any
    partition: Callable[[int], Any]
    min_replies: int = 1
    round_timeout: float = 600.0
    connect_timeout: float = 120.0

    @property
    def fingerprint(self) -> bytes:
        return config_fingerprint(self.config)


def _record(**fields) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord(fields)})


def _fields(message: Message) -> dict:
    return dict(message.content.config_records[RECORD]) if RECORD in message.content.config_records else {}


def flower_message_bytes(message: Message) -> int:
    """The size of ``message`` as Flower serialises it (its protobuf), header and metadata included."""
    from flwr.common.serde import message_to_proto

    return int(message_to_proto(message).ByteSize())


def _handshake(grid: Grid, fed: Federation) -> dict[int, int]:
    """``{client_id: node_id}``: every SuperNode's client id and fingerprint, checked."""
    deadline = time.monotonic() + fed.connect_timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < fed.num_clients:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(nodes)} SuperNodes connected in {fed.connect_timeout:.0f} s, the run needs "
                f"{fed.num_clients} (one per client): start the missing SuperNodes or lower num_clients"
            )
        time.sleep(0.5)
        nodes = list(grid.get_node_ids())
    asks = [
        Message(content=_record(fingerprint=fed.fingerprint), dst_node_id=n, message_type="query")
        for n in nodes
    ]
    node_of = {}
    for reply in grid.send_and_receive(asks, timeout=fed.connect_timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            raise RuntimeError(f"SuperNode {node} refused the run at the handshake: {reply.error.reason}")
        fields = _fields(reply)
        if fields.get("fingerprint") != fed.fingerprint:
            raise RuntimeError(
                f"SuperNode {node} was started for another configuration or seed (fingerprint "
                f"{bytes(fields.get('fingerprint', b'')).hex()}, the run's {fed.fingerprint.hex()})"
            )
        cid = int(fields["client_id"])
        if not 0 <= cid < fed.num_clients or cid in node_of:
            raise RuntimeError(
                f"SuperNode {node} says it holds client {cid}: each of the {fed.num_clients} clients must be "
                f"held by exactly one SuperNode (node config partition-id=0..{fed.num_clients - 1}); taken: "
                f"{sorted(node_of)}"
            )
        node_of[cid] = node
    if len(node_of) != fed.num_clients:
        raise RuntimeError(
            f"{len(node_of)} of {fed.num_clients} SuperNodes answered the handshake in "
            f"{fed.connect_timeout:.0f} s"
        )
    return node_of


def server_app(
    build: Callable[[dict, dict | None], Federation],
    *,
    on_round: Callable[[RoundReport, ServerParty, dict], None] | None = None,
    on_start: Callable[[Federation, dict], None] | None = None,
) -> ServerApp:
    """The ``ServerApp`` of a run: ``build(run_config, None)`` gives the :class:`Federation`;
    ``on_start(federation, run_config)`` and ``on_round(report, server_party, extra)`` (the round's
    :class:`sidejax.flower.RoundReport`; ``extra`` holds Flower's serialised message sizes and the round's
    wall time) write results."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = dict(context.run_config)
        fed = build(run_config, None)
        if on_start is not None:
            on_start(fed, run_config)
        from sidejax.fl.roles import initial_parties

        node_of = _handshake(grid, fed)
        server, client0 = initial_parties(fed.algorithm, fed.init_key, fed.params, fed.num_clients, 0)
        party = ServerParty(
            fed.algorithm,
            fed.base_key,
            server,
            client0,
            fed.partition(0),
            fed.num_clients,
            fingerprint=fed.fingerprint,
            min_replies=fed.min_replies,
        )
        for _ in range(fed.num_rounds):
            start = time.perf_counter()
            opening = party.open_round()
            out, sent_sizes = [], {}
            for cid, node in node_of.items():
                envelope = opening.downlinks.get(cid, opening.listen)
                if envelope is None:
                    continue
                msg = Message(content=_record(envelope=envelope), dst_node_id=node, message_type="train")
                sent_sizes[cid] = flower_message_bytes(msg)
                out.append(msg)
            client_of = {node: cid for cid, node in node_of.items()}
            replies, reply_sizes, info_sizes, lost = {}, {}, {}, {}
            for reply in grid.send_and_receive(out, timeout=fed.round_timeout):
                cid = client_of.get(reply.metadata.src_node_id)
                if cid is None:
                    continue
                if reply.has_error():
                    if reply.error.code in _LOST:  # the node or its app is gone: a missing reply
                        lost[cid] = reply.error.reason
                        continue
                    raise RoundFailedError(
                        f"round {opening.round_index}: client {cid} (SuperNode {reply.metadata.src_node_id}) "
                        f"failed: {reply.error.reason}"
                    )
                fields = _fields(reply)
                if cid in opening.participants and "envelope" in fields:
                    replies[cid] = Reply(fields["envelope"], fields["info"], int(fields["num_examples"]))
                    reply_sizes[cid] = flower_message_bytes(reply)
                    info_sizes[cid] = len(fields["info"])
            report = party.close_round(replies)
            if on_round is not None:
                extra = {
                    "flower_downlink_bytes": [sent_sizes.get(c, 0) for c in opening.participants],
                    "flower_uplink_bytes": [reply_sizes.get(c, 0) for c in opening.participants],
                    "uplink_info_bytes": [info_sizes.get(c, 0) for c in opening.participants],
                    "lost": {str(c): reason for c, reason in lost.items()},
                    "seconds": time.perf_counter() - start,
                }
                on_round(report, party, extra)

    return app


def flip_mod(msg: Message, context: Context, call_next) -> Message:
    """A ClientApp mod for the fault tests: with ``SIDEJAX_FLOWER_FLIP="R:C"`` set, flips one byte of the
    stream in client ``C``'s uplink envelope of round ``R`` after the ClientApp sealed it (its CRC no longer
    matches). Without the variable it passes every message through unchanged."""
    import os

    reply = call_next(msg, context)
    spec = os.environ.get(FLIP_ENV)
    fields = _fields(reply) if not reply.has_error() else {}
    if not spec or "envelope" not in fields:
        return reply
    rnd, cid = (int(v) for v in spec.split(":"))
    from sidejax.flower.envelope import ENVELOPE_BYTES

    head = fields["envelope"][:ENVELOPE_BYTES]
    env_round = int.from_bytes(head[8:12], "little")
    env_client = int.from_bytes(head[12:16], "little")
    if (env_round, env_client) != (rnd, cid) or len(fields["envelope"]) <= ENVELOPE_BYTES + 8:
        return reply
    flipped = bytearray(fields["envelope"])
    flipped[ENVELOPE_BYTES + 8] ^= 0x01  # the first byte of the stream
    reply.content.config_records[RECORD]["envelope"] = bytes(flipped)
    return reply


_PARTIES: dict[tuple, ClientParty] = {}


def client_app(
    build: Callable[[dict, dict | None], Federation], *, fingerprint: Callable[[dict], bytes] | None = None
) -> ClientApp:
    """The ``ClientApp`` of a run: the SuperNode's node configuration ``partition-id`` is its client id;
    ``build(run_config, node_config)`` gives the :class:`Federation` (built once per process: the kernels
    compile once). What the client keeps between rounds (its state, its view of the server state) lives in
    Flower's ``Context.state``, so it persists however the SuperNode runs its ``ClientApp``.
    ``fingerprint(run_config)``, when given, answers the handshake without building the run (it must equal
    the :class:`Federation`'s)."""
    app = ClientApp(mods=[flip_mod])

    def party_for(context: Context) -> ClientParty:
        run_config, node_config = dict(context.run_config), dict(context.node_config)
        if "partition-id" not in node_config:
            raise ValueError(
                "the SuperNode has no partition-id in its node configuration: start it with "
                "--node-config 'partition-id=C num-partitions=N' (C its client id)"
            )
        cid = int(node_config["partition-id"])
        key = (json.dumps(run_config, sort_keys=True, default=repr), cid)
        party = _PARTIES.get(key)
        saved = context.state.config_records.get(RECORD)
        if party is None:
            import jax

            from sidejax.fl.roles import initial_parties

            fed = build(run_config, node_config)
            start = (fed.algorithm, fed.init_key, fed.params, fed.num_clients, cid)
            # resuming a client needs the shapes only: the values come from Context.state
            view, cstate = (
                initial_parties(*start) if saved is None else jax.eval_shape(lambda: initial_parties(*start))
            )
            party = ClientParty(
                fed.algorithm,
                fed.base_key,
                cid,
                fed.num_clients,
                view,
                cstate,
                fed.partition(cid),
                fingerprint=fed.fingerprint,
            )
            _PARTIES[key] = party
            if saved is None:
                party.initial = party.state_bytes()
        party.load_state(saved["state"] if saved is not None else party.initial)
        return party

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        if fingerprint is None:
            party = party_for(context)
            cid, fp = party.client_id, party.fingerprint
        else:
            cid = int(dict(context.node_config).get("partition-id", -1))
            fp = fingerprint(dict(context.run_config))
        return Message(content=_record(client_id=cid, fingerprint=fp), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        party = party_for(context)
        reply = party.handle(_fields(msg)["envelope"])
        context.state.config_records[RECORD] = ConfigRecord({"state": party.state_bytes()})
        if reply is None:
            return Message(content=_record(listened=True), reply_to=msg)
        return Message(
            content=_record(envelope=reply.envelope, info=reply.info, num_examples=reply.num_examples),
            reply_to=msg,
        )

    return app
