"""The server and a client of a federation whose parties run apart and exchange bytes: the transport-free core
of :mod:`sidejax.flower` (no Flower import here).

A :class:`ServerParty` holds the server state; each round it opens (:meth:`ServerParty.open_round`: the
participants, computed from the run's key, and the downlink envelopes) and closes
(:meth:`ServerParty.close_round`: the participants' uplink envelopes in, the engine's ``server_update``,
the round's :class:`sidejax.fl.RoundInfo` out). A :class:`ClientParty` holds one client's state, its view of
the server state (:mod:`sidejax.fl.roles`) and its own examples only; it answers a downlink envelope with an
uplink :class:`Reply` when it is a participant, and keeps its view current when it is not. Every key derives
from the run's key, the round and the client's global id (:mod:`sidejax.keys`), so both ends regenerate the
same candidates and dithers, and the messages are the engine's (:func:`sidejax.fl.run_rounds`) bit for bit.

The kernels (:func:`sidejax.fl.roles.server_open`, :func:`~sidejax.fl.roles.client_step`,
:func:`~sidejax.fl.roles.server_close`) are jitted: each compiles once per process and shape.

Faults, as the engine treats them: a participant whose reply does not arrive, or whose stream was corrupted
in transit (the envelope's CRC-32), is excluded from the round's aggregate like a withheld stream (the
server's ``included`` mask), and the corruption is flagged in ``RoundInfo.uplink_errors`` with
:data:`sidejax.coding.ERR_CRC`; fewer replies than ``min_replies`` stop the round with
:class:`RoundFailedError`; an envelope of another configuration, seed or round is refused with
:class:`sidejax.flower.EnvelopeError`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.bits import BITS_DTYPE
from sidejax.coding.base import ERR_CRC, WITHHELD_BITS, Message
from sidejax.fl.base import Algorithm, ClientData, RoundInfo
from sidejax.fl.roles import (
    client_listen,
    client_skip,
    client_step,
    round_participants,
    server_close,
    server_open,
)
from sidejax.flower.envelope import (
    DOWNLINK,
    EVERY_CLIENT,
    NOTICE,
    UPLINK,
    WITHHELD,
    EnvelopeError,
    open_envelope,
    seal,
)
from sidejax.types import PRNGKey, PyTree

__all__ = [
    "Reply",
    "RoundOpening",
    "RoundReport",
    "RoundFailedError",
    "ServerParty",
    "ClientParty",
    "own_partition",
    "tree_to_bytes",
    "tree_from_bytes",
    "pack_tree",
    "unpack_tree",
    "loopback_round",
]


class RoundFailedError(RuntimeError):
    """A round that cannot be aggregated: fewer replies than the run's minimum, or a client reported an
    error. The server state is left as it was before the round."""


class Reply(NamedTuple):
    """A client's answer to a downlink: its uplink ``envelope`` (bytes, :mod:`sidejax.flower.envelope`),
    its :class:`sidejax.fl.ClientInfo` as ``info`` bytes (:func:`pack_tree`: diagnostics such as its loss
    and the coder's ideal rate, which the engine's :class:`sidejax.fl.RoundInfo` records; not part of the
    coded message, and counted apart from it) and its example count (the server's aggregation weight)."""

    envelope: bytes
    info: bytes
    num_examples: int


class RoundOpening(NamedTuple):
    """What the server sends in round ``round_index``: ``participants`` (global ids, ascending),
    ``downlinks[c]`` the envelope for participant ``c``, and ``listen`` the envelope every other client gets:
    the shared downlink, or with one downlink per participant a round notice (no stream), so that every
    client keeps its view of the server state current."""

    round_index: int
    participants: tuple[int, ...]
    downlinks: dict[int, bytes]
    listen: bytes | None


class RoundReport(NamedTuple):
    """What happened to round ``round_index`` on the server: ``info`` (the engine's :class:`RoundInfo`),
    ``missing`` (participants whose reply did not arrive), ``corrupt`` (whose stream failed its CRC),
    ``downlink_bytes`` / ``uplink_bytes`` (per participant, the envelopes' lengths) and
    ``uplink_stream_bytes`` (their streams alone, ``ceil(num_bits / 8)``); ``messages``: the uplink
    messages the server decoded, stacked in participant order (a missing or corrupt one withheld)."""

    round_index: int
    info: RoundInfo
    missing: tuple[int, ...]
    corrupt: tuple[int, ...]
    downlink_bytes: tuple[int, ...]
    uplink_bytes: tuple[int, ...]
    uplink_stream_bytes: tuple[int, ...]
    messages: Message


def _to_host(leaf):
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


def tree_to_bytes(tree: PyTree) -> bytes:
    """``tree``'s leaves as bytes (NumPy's ``.npz``, in leaf order; typed PRNG keys as their key data): a
    party's state in a transport's key-value store (Flower's ``Context.state``)."""
    buf = io.BytesIO()
    np.savez(buf, *[_to_host(leaf) for leaf in jax.tree.leaves(tree)])
    return buf.getvalue()


def tree_from_bytes(template: PyTree, data: bytes, *, what: str = "state") -> PyTree:
    """The tree :func:`tree_to_bytes` wrote, with ``template``'s structure, shapes and dtypes (typed keys
    wrapped again); ``ValueError`` naming ``what`` when the bytes do not fit the template."""
    leaves, treedef = jax.tree.flatten(template)
    try:
        with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as npz:
            arrays = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    except Exception as exc:
        raise ValueError(f"{what} is not a saved sidejax tree ({type(exc).__name__}: {exc})") from exc
    if len(arrays) != len(leaves):
        raise ValueError(f"{what} holds {len(arrays)} arrays, the expected state has {len(leaves)}")
    out = []
    for i, (leaf, arr) in enumerate(zip(leaves, arrays, strict=True)):
        # the template's leaves: arrays, or jax.ShapeDtypeStruct (the shapes alone)
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        is_key = jnp.issubdtype(dtype, jax.dtypes.prng_key)
        want = (
            jax.eval_shape(jax.random.key_data, leaf)
            if is_key
            else jax.ShapeDtypeStruct(np.shape(leaf), dtype)
        )
        if tuple(arr.shape) != tuple(want.shape) or arr.dtype != want.dtype:
            raise ValueError(
                f"{what}: leaf {i} is {arr.dtype}{list(arr.shape)}, expected "
                f"{want.dtype}{list(want.shape)} (another algorithm or configuration?)"
            )
        out.append(
            jax.random.wrap_key_data(arr, impl=jax.random.key_impl(leaf)) if is_key else jnp.asarray(arr)
        )
    return jax.tree.unflatten(treedef, out)


def pack_tree(tree: PyTree) -> bytes:
    """``tree``'s leaves' raw little-endian bytes, back to back, nothing else: the compact form of a value
    whose structure, shapes and dtypes the receiver knows (a participant's :class:`sidejax.fl.ClientInfo`
    on the wire). :func:`unpack_tree` is the inverse."""
    return b"".join(
        np.ascontiguousarray(_to_host(leaf)).astype(_to_host(leaf).dtype.newbyteorder("<")).tobytes()
        for leaf in jax.tree.leaves(tree)
    )


def unpack_tree(template: PyTree, data: bytes, *, what: str = "value") -> PyTree:
    """The tree :func:`pack_tree` wrote, with ``template``'s structure, shapes and dtypes (arrays or
    ``jax.ShapeDtypeStruct``); ``ValueError`` naming ``what`` when the length does not match."""
    leaves, treedef = jax.tree.flatten(template)
    specs = [(tuple(np.shape(leaf)), np.dtype(jnp.result_type(leaf))) for leaf in leaves]
    need = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs)
    data = bytes(data)
    if len(data) != need:
        raise ValueError(f"{what} is {len(data)} bytes, the expected value has {need}")
    out, offset = [], 0
    for shape, dtype in specs:
        size = int(np.prod(shape)) * dtype.itemsize
        out.append(
            jnp.asarray(
                np.frombuffer(data, dtype.newbyteorder("<"), offset=offset, count=int(np.prod(shape)))
                .astype(dtype)
                .reshape(shape)
            )
        )
        offset += size
    return jax.tree.unflatten(treedef, out)


def own_partition(data, client_id: int) -> ClientData:
    """Client ``client_id``'s examples alone, as its program reads them: its rows of ``data`` (a
    :class:`sidejax.data.FederatedData`) in its index order, zero rows after its ``num_examples`` (the
    federation's ``max_examples`` in all, so every client's program has the engine's shapes), and the
    local indices ``0..max_examples-1``. What a client process holds instead of the federation."""
    idx = np.asarray(data.client_indices)[client_id]
    n = int(np.asarray(data.num_examples)[client_id])
    x = np.asarray(data.x)[idx]
    y = np.asarray(data.y)[idx]
    x[n:] = 0
    y[n:] = 0
    return ClientData(jnp.asarray(x), jnp.asarray(y), jnp.arange(idx.shape[0], dtype=jnp.int32), jnp.int32(n))


def _spec(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _participant_program(algorithm, base_key, view, client_state, data, num_clients):
    """The shapes of one participant's downlink and outputs: ``(downlink, (state, message, info, view))``."""
    _, _, downlink = jax.eval_shape(lambda s: server_open(algorithm, base_key, 0, s, num_clients), view)
    own = (
        downlink
        if not downlink.num_bits.shape
        else jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), downlink)
    )
    outputs = jax.eval_shape(
        lambda v, c, m, d: client_step(algorithm, base_key, 0, 0, v, c, m, d, num_clients),
        view,
        client_state,
        own,
        data,
    )
    return own, outputs


class ServerParty:
    """The server of a federation whose clients run elsewhere.

    Args:
      algorithm: the :class:`sidejax.fl.Algorithm` (the same at every party).
      base_key: the run's rounds key (:func:`sidejax.keys.run_keys`' second key; what
        :func:`sidejax.fl.run_rounds` takes as ``base_key``).
      server: the server state to start from (:func:`sidejax.fl.roles.initial_parties`, or a checkpoint).
      client_state: one client's initial state (its shapes: the clients' program), e.g. client 0's row.
      client_data: one client's :class:`sidejax.fl.ClientData` or its shapes (``jax.ShapeDtypeStruct``):
        the federation's ``max_examples`` and example shape.
      num_clients: clients in the federation.
      fingerprint: :func:`sidejax.flower.config_fingerprint` of the run's configuration.
      round_index: the next round (0 for a new run).
      min_replies: the fewest participants' replies a round is aggregated from (default: 1); fewer stop
        the round with :class:`RoundFailedError`.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        base_key: PRNGKey,
        server: PyTree,
        client_state: PyTree,
        client_data: ClientData,
        num_clients: int,
        *,
        fingerprint: bytes,
        round_index: int = 0,
        min_replies: int = 1,
    ):
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"algorithm must be a sidejax.fl.Algorithm, got {type(algorithm).__name__}")
        if min_replies < 1:
            raise ValueError(f"min_replies must be >= 1, got {min_replies}")
        self.algorithm, self.base_key, self.server = algorithm, base_key, server
        self.num_clients, self.fingerprint = int(num_clients), bytes(fingerprint)
        self.round_index, self.min_replies = int(round_index), int(min_replies)
        _, outputs = _participant_program(
            algorithm, base_key, server, _spec(client_state), _spec(client_data), self.num_clients
        )
        self._message_spec, self._info_spec = outputs[1], outputs[2]
        self._open = None

    def open_round(self) -> RoundOpening:
        """Opens round ``self.round_index``: its participants and downlink envelopes."""
        t = self.round_index
        ids, sent_server, downlink = server_open(
            self.algorithm, self.base_key, t, self.server, self.num_clients
        )
        ids = tuple(int(i) for i in np.asarray(ids))
        fp = self.fingerprint
        if np.ndim(downlink.num_bits) == 0:
            env = seal(DOWNLINK, downlink, round_index=t, client_id=EVERY_CLIENT, fingerprint=fp)
            downlinks, listen = {c: env for c in ids}, env
        else:
            downlinks = {
                c: seal(
                    DOWNLINK,
                    jax.tree.map(lambda a, j=j: a[j], downlink),
                    round_index=t,
                    client_id=c,
                    fingerprint=fp,
                )
                for j, c in enumerate(ids)
            }
            listen = seal(NOTICE, None, round_index=t, client_id=EVERY_CLIENT, fingerprint=fp)
        self._open = (t, ids, sent_server, downlink, downlinks)
        return RoundOpening(t, ids, downlinks, listen)

    def _withheld(self):
        words = self._message_spec.payload.shape[-1]
        info = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self._info_spec)
        info = info._replace(
            loss=np.full(np.shape(info.loss), np.nan, np.float32),
            finite=np.zeros(np.shape(info.finite), bool),
            valid=np.zeros(np.shape(info.valid), bool),
        )
        return Message(np.zeros(words, np.uint32), np.asarray(WITHHELD_BITS, BITS_DTYPE)), info, 0

    def close_round(self, replies: Mapping[int, Reply | None]) -> RoundReport:
        """Closes the open round from the participants' ``replies`` (``None`` or absent: did not arrive).

        Raises:
          RoundFailedError: fewer than ``min_replies`` usable replies (the state is kept; the round can be
            opened again).
          EnvelopeError: an envelope of another configuration, seed or round (a misconfigured party).
        """
        if self._open is None:
            raise RuntimeError("close_round: no round is open; call open_round first")
        t, ids, sent_server, downlink, downlinks = self._open
        messages, infos, counts, missing, corrupt, up_bytes, stream_bytes = [], [], [], [], [], [], []
        for c in ids:
            reply = replies.get(c)
            if reply is None:
                missing.append(c)
                message, info, n = self._withheld()
                up_bytes.append(0)
                stream_bytes.append(0)
            else:
                up_bytes.append(len(reply.envelope))
                try:
                    env = open_envelope(
                        reply.envelope,
                        fingerprint=self.fingerprint,
                        round_index=t,
                        kinds=(UPLINK, WITHHELD),
                        what=f"client {c}'s uplink of round {t}",
                    )
                except EnvelopeError as exc:
                    if not exc.corrupt:
                        raise
                    corrupt.append(c)
                    env = None
                if env is not None and env.client_id != c:
                    raise EnvelopeError(f"the reply for client {c} was sent as client {env.client_id}")
                if env is None or env.kind == WITHHELD:
                    message, _, _ = self._withheld()
                    stream_bytes.append(0)
                else:
                    message = env.message
                    if message.payload.shape[0] != self._message_spec.payload.shape[-1]:
                        raise EnvelopeError(
                            f"client {c}'s uplink has capacity {message.payload.shape[0]} words, this "
                            f"server's program {self._message_spec.payload.shape[-1]}: another configuration"
                        )
                    stream_bytes.append(env.stream_bytes)
                info = unpack_tree(self._info_spec, reply.info, what=f"client {c}'s info of round {t}")
                n = int(reply.num_examples)
            messages.append(message)
            infos.append(info)
            counts.append(n)
        arrived = len(ids) - len(missing) - len(corrupt)
        if arrived < self.min_replies:
            self._open = None
            raise RoundFailedError(
                f"round {t}: {arrived} usable replies of {len(ids)} participants (missing: {missing}, "
                f"corrupt: {corrupt}), fewer than min_replies={self.min_replies}; the server state is "
                "unchanged"
            )
        stack = lambda *a: jnp.stack([jnp.asarray(x) for x in a])  # noqa: E731
        messages = jax.tree.map(stack, *messages)
        infos = jax.tree.map(stack, *infos)
        server, info = server_close(
            self.algorithm,
            self.base_key,
            t,
            sent_server,
            jnp.asarray(ids, jnp.int32),
            downlink,
            messages,
            infos,
            jnp.asarray(counts, jnp.int32),
        )
        if corrupt:
            flag = jnp.asarray([c in corrupt for c in ids])
            info = info._replace(
                uplink_errors=jnp.where(flag, info.uplink_errors | ERR_CRC, info.uplink_errors),
                included=info.included & ~flag,
            )
        self.server, self.round_index, self._open = server, t + 1, None
        return RoundReport(
            t,
            info,
            tuple(missing),
            tuple(corrupt),
            tuple(len(downlinks[c]) for c in ids),
            tuple(up_bytes),
            tuple(stream_bytes),
            messages,
        )


class ClientParty:
    """One client of a federation whose server runs elsewhere: its own state, its view of the server state
    and its own examples.

    Args:
      algorithm: the :class:`sidejax.fl.Algorithm` (the server's).
      base_key: the run's rounds key (the server's).
      client_id: this client's global id.
      num_clients: clients in the federation.
      view: its view of the server state (at the start: ``init``'s server state,
        :func:`sidejax.fl.roles.initial_parties`).
      client_state: its own state (at the start: its row of ``init``'s client state).
      data: its examples (:func:`own_partition`).
      fingerprint: :func:`sidejax.flower.config_fingerprint` of the run's configuration (the server's).
      round_index: the next round it expects.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        base_key: PRNGKey,
        client_id: int,
        num_clients: int,
        view: PyTree,
        client_state: PyTree,
        data: ClientData,
        *,
        fingerprint: bytes,
        round_index: int = 0,
    ):
        if not 0 <= int(client_id) < int(num_clients):
            raise ValueError(f"client_id must be in [0, num_clients={num_clients}), got {client_id}")
        self.algorithm, self.base_key = algorithm, base_key
        self.client_id, self.num_clients = int(client_id), int(num_clients)
        self.view, self.client_state, self.data = view, client_state, data
        self.fingerprint, self.round_index = bytes(fingerprint), int(round_index)
        self._own_downlink, _ = _participant_program(
            algorithm, base_key, view, _spec(client_state), _spec(data), self.num_clients
        )

    def state_bytes(self) -> bytes:
        """What this client keeps between rounds (its state, its view, the next round) as bytes."""
        return tree_to_bytes((self.client_state, self.view, np.int32(self.round_index)))

    def load_state(self, data: bytes) -> None:
        """Restores :meth:`state_bytes`' state (``ValueError`` when it does not fit this configuration)."""
        template = (self.client_state, self.view, np.int32(0))
        self.client_state, self.view, rnd = tree_from_bytes(template, data, what="the client's saved state")
        self.round_index = int(rnd)

    def handle(self, envelope: bytes) -> Reply | None:
        """Answers a downlink envelope: a participant of its round runs its step and returns its
        :class:`Reply` (its stream withheld, as the engine does, when its encoder's input was invalid or its
        result not finite); any other client updates its view from the shared downlink and returns ``None``.

        Raises:
          EnvelopeError: another configuration or seed, an earlier round than this client has seen, a
            downlink addressed to another client, or corrupted bytes.
        """
        env = open_envelope(
            envelope,
            fingerprint=self.fingerprint,
            kinds=(DOWNLINK, NOTICE),
            what=f"the downlink to client {self.client_id}",
        )
        t = env.round_index
        if t < self.round_index:
            raise EnvelopeError(
                f"client {self.client_id} has run round {self.round_index - 1}; a downlink of "
                f"round {t} is a replay"
            )
        if env.client_id not in (EVERY_CLIENT, self.client_id):
            raise EnvelopeError(
                f"the downlink of round {t} is addressed to client {env.client_id}, this is "
                f"client {self.client_id}"
            )
        if env.kind == NOTICE:
            if self.client_id in np.asarray(
                round_participants(self.algorithm, self.base_key, t, self.num_clients)
            ):
                raise EnvelopeError(
                    f"client {self.client_id} is a participant of round {t} but got no downlink"
                )
            self.view = client_skip(self.algorithm, self.base_key, t, self.view, self.num_clients)
            self.round_index = t + 1
            return None
        if env.capacity_words != self._own_downlink.payload.shape[0]:
            raise EnvelopeError(
                f"the downlink of round {t} has capacity {env.capacity_words} words, this "
                f"client's program {self._own_downlink.payload.shape[0]}: another configuration"
            )
        ids = np.asarray(round_participants(self.algorithm, self.base_key, t, self.num_clients))
        mine = (self.algorithm, self.base_key, t, self.client_id, self.view, self.client_state, env.message)
        if self.client_id not in ids:
            if env.client_id != EVERY_CLIENT:
                raise EnvelopeError(
                    f"client {self.client_id} received an own downlink for round {t}, in which "
                    "it is not a participant"
                )
            self.view = client_listen(*mine, self.num_clients)
            self.round_index = t + 1
            return None
        state, message, info, view = client_step(*mine, self.data, self.num_clients)
        sent = bool(np.all(np.asarray(info.valid))) and bool(np.all(np.asarray(info.finite)))
        errors = int(np.bitwise_or.reduce(np.asarray(info.downlink_errors, np.int64).reshape(-1), initial=0))
        out = seal(
            UPLINK if sent else WITHHELD,
            message if sent else None,
            round_index=t,
            client_id=self.client_id,
            fingerprint=self.fingerprint,
            error_bits=errors,
        )
        self.client_state, self.view, self.round_index = state, view, t + 1
        return Reply(out, pack_tree(info), int(np.asarray(self.data.num_examples)))


def loopback_round(
    server: ServerParty,
    clients: Mapping[int, ClientParty],
    *,
    tamper: Callable[[int, bytes], bytes | None] | None = None,
) -> RoundReport:
    """One round with every party in this process, the envelopes passed as bytes: the reference transport
    (the Flower apps do the same over the network). ``tamper(client_id, envelope)`` may change or drop
    (``None``) an uplink in transit: the fault tests' hook."""
    opening = server.open_round()
    replies = {}
    for c, party in clients.items():
        envelope = opening.downlinks.get(c, opening.listen)
        if envelope is None:
            continue
        reply = party.handle(envelope)
        if reply is not None and tamper is not None:
            changed = tamper(c, reply.envelope)
            reply = None if changed is None else reply._replace(envelope=changed)
        if c in opening.participants:
            replies[c] = reply
    return server.close_round(replies)
