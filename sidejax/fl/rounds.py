"""The round engine: one round as a pure function, and ``lax.scan`` over rounds.

One round (:func:`build_round_step`):

1. **Sample.** ``client_ids = sample_clients(stream_key(round_key, SAMPLING), num_clients,
   clients_per_round)``: uniformly without replacement, inside jit.
2. **Downlink.** ``server', message = algorithm.broadcast(stream_key(round_key, DOWNLINK), server,
   client_ids)``: one :class:`sidejax.coding.Message` shared by every participant (scalar ``num_bits``) or
   one per participant (``num_bits[clients]``), and the server's record of what it sent (``server'``, seen
   by step 4). ``RoundInfo.downlink_bits`` is read from the message.
3. **Clients.** Each participant decodes the downlink (``algorithm.receive(downlink_key, keys, server,
   client_state, message)``, its own message when the downlink is per participant) and runs
   ``client_update(client_keys(round_key, id), received, state, data)``, with keys derived from its
   *global* id (every key comes from :mod:`sidejax.keys`). The
   participants run under ``jax.vmap`` (``"vmap"``, best on accelerators) or sequentially under
   ``jax.lax.map`` (``"map"``, the CPU default: memory for one client at a time, 37% less peak memory at
   50-100 clients), optionally vmapping ``batch_size`` clients per map step (blackjax's ``map_fn``
   trade-off). That choice is the engine's (:class:`ClientMap`), passed once, not a parameter of the
   algorithms.
4. **Server.** ``server_update(round_key, server, client_ids, shared_keys, messages, weights)`` with the
   participants' shared keys (derived here, by the engine), the stacked uplink messages and the
   participants' example counts as weights; it returns the new state, its diagnostics and each uplink
   stream's error bitmask. A participant whose ``ClientInfo`` says its encoder's input was invalid
   (``valid`` False) or its result not finite (``finite`` False) sends no stream: the engine withholds its
   message (:func:`sidejax.coding.withhold`, length -1), which the server reads from the message itself.
   The aggregation contract every ``server_update`` keeps: a participant is included iff its
   stream was sent and decodes valid (:func:`sidejax.coding.included`); aggregates are taken over the
   included participants alone, their weights renormalised (:func:`sidejax.utils.masked_mean`), and a
   server with none included keeps its previous state (:func:`sidejax.utils.keep_unless_none`).
   ``RoundInfo.included`` (sent and ``uplink_errors == 0``) says who counted in this round.
5. **Write back** the participants' client states with ``.at[client_ids].set``.

:func:`run_rounds` scans ``round_step`` over rounds under one ``jit``. Round ``t`` uses
``round_key(base_key, t)`` with ``t`` read from the state, so ``run_rounds(·, 5)`` twice equals
``run_rounds(·, 10)`` once, bit for bit, and a resumed run continues exactly.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from sidejax.bits import as_bits
from sidejax.coding.base import withhold
from sidejax.fl.base import Algorithm, ClientData, ClientInfo, RoundInfo, RoundState
from sidejax.keys import DOWNLINK, SAMPLING, client_keys, round_key, stream_key
from sidejax.types import PRNGKey, PyTree
from sidejax.utils import is_concrete, tree_all_finite

__all__ = [
    "CLIENT_STRATEGIES",
    "CLIENT_AXIS",
    "default_client_strategy",
    "sample_clients",
    "check_federation",
    "ClientMap",
    "mesh_client_map",
    "as_client_map",
    "ClientPhase",
    "PartialRound",
    "build_round_step",
    "client_state_split",
    "place_federation",
    "gather_to_host",
    "run_rounds",
    "start_round",
    "run_clients",
    "finish_round",
    "draw_participants",
    "open_downlink",
    "participate",
    "close_round",
]

CLIENT_STRATEGIES = ("vmap", "map")
#: The default name of the mesh axis the participants are split over (:class:`ClientMap`).
CLIENT_AXIS = "clients"


def default_client_strategy() -> str:
    """The client strategy a builder uses when given ``client_strategy=None``: ``"map"`` on CPU, ``"vmap"``
    on GPU/TPU (from ``jax.default_backend()``).

    On CPU, running participants one after another (``lax.map``) holds one client's activations at a time:
    37% less peak memory than ``vmap`` at 50-100 clients, and it was 2.2-2.4x faster there with the
    convolutions as they were before issue 12. With today's LeNet5 convolution the two run at the same
    speed on 2 CPU cores (map/vmap throughput 1.02 at 50 clients, 0.89 at 10;
    ``experiments/bench/local_training.py``), so the memory decides. On accelerators ``vmap`` fills the
    device and wins. This is the only place that chooses; pass ``client_strategy`` explicitly to override it.
    """
    return "map" if jax.default_backend() == "cpu" else "vmap"


def sample_clients(key: PRNGKey, num_clients: int, clients_per_round: int) -> jax.Array:
    """Samples ``clients_per_round`` distinct client ids uniformly, returned in ascending order.

    Args:
      key: the round's sampling key (``stream_key(round_key, SAMPLING)``).
      num_clients: total number of clients (static).
      clients_per_round: participants per round (static), ``1 <= clients_per_round <= num_clients``.

    Returns:
      int32 ``[clients_per_round]``.
    """
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(
            f"clients_per_round must be in [1, num_clients={num_clients}], got {clients_per_round}"
        )
    if clients_per_round == num_clients:
        return jnp.arange(num_clients, dtype=jnp.int32)
    ids = jax.random.permutation(key, num_clients)[:clients_per_round]
    return jnp.sort(ids).astype(jnp.int32)


def check_federation(state: RoundState, data) -> None:
    """Raises a ``ValueError`` if ``data`` does not hold the number of clients ``state`` was built for.

    Compares ``data.num_examples.shape[0]`` (static) with the leading axis of every per-client state leaf
    (static) and, when it is concrete (outside ``jit``), with ``state.num_clients``. Without this, ``init``
    for 7 clients and data of 10 would sample clients 7-9, whose client-state rows do not exist (JAX clamps
    the gather and drops the scatter, silently).
    """
    num_clients = int(data.num_examples.shape[0])
    fix = "call algorithm.init(key, params, num_clients) with the data's number of clients, or pass the data"
    for leaf in jax.tree.leaves(state.clients):
        if leaf.ndim == 0 or leaf.shape[0] != num_clients:
            rows = leaf.shape[0] if leaf.ndim else "no"
            raise ValueError(
                f"the client state is stacked over {rows} clients but the data has {num_clients} clients "
                f"(data.num_examples.shape[0]); {fix} the state was built for"
            )
    n = state.num_clients
    if n is None or not is_concrete(n):
        return
    if int(n) != num_clients:
        raise ValueError(
            f"the state was initialised for num_clients={int(n)} but the data has {num_clients} clients "
            f"(data.num_examples.shape[0]); {fix} the state was built for"
        )


def _take(tree: PyTree, ids: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: a[ids], tree)


def _put(tree: PyTree, ids: jax.Array, values: PyTree) -> PyTree:
    return jax.tree.map(lambda a, v: a.at[ids].set(v), tree, values)


class ClientMap(NamedTuple):
    """How the engine maps the participants' work: an engine choice, passed once to
    :func:`build_round_step` / :func:`run_rounds` (not to every algorithm builder).

    Attributes:
      strategy: ``"vmap"`` (all participants at once), ``"map"`` (sequential ``lax.map``), or ``None`` for
        :func:`default_client_strategy` (``"map"`` on CPU, ``"vmap"`` on GPU/TPU).
      batch_size: with ``"map"``, vmap this many clients per map step (``None``: one at a time).
      mesh: ``None`` (every participant on one device), or a :class:`jax.sharding.Mesh` with an axis named
        ``axis``: the round's participants are split into equal contiguous shares over that axis's devices
        (``shard_map``), and each device runs its share with ``strategy``. A participant count that the
        devices do not divide is padded with copies of the first participant, whose results are dropped.
        The other mesh axes, if any, hold replicas. See :func:`mesh_client_map`.
      axis: the name of the mesh axis the participants are split over.
    """

    strategy: str | None = None
    batch_size: int | None = None
    mesh: Mesh | None = None
    axis: str = CLIENT_AXIS

    def resolved(self) -> ClientMap:
        """This map with ``strategy`` resolved and every field checked."""
        strategy = default_client_strategy() if self.strategy is None else self.strategy
        if strategy not in CLIENT_STRATEGIES:
            raise ValueError(f"client_map.strategy must be one of {CLIENT_STRATEGIES}, got {strategy!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"client_map.batch_size must be None or >= 1, got {self.batch_size}")
        if self.mesh is not None:
            if not isinstance(self.mesh, Mesh):
                raise TypeError(f"client_map.mesh must be None or a jax.sharding.Mesh, got {self.mesh!r}")
            if self.axis not in self.mesh.axis_names:
                raise ValueError(
                    f"client_map.mesh has axes {tuple(self.mesh.axis_names)} but no axis named "
                    f"{self.axis!r} to split the participants over: build it with "
                    f"sidejax.fl.mesh_client_map(), or name one of its axes {self.axis!r}"
                )
        return ClientMap(strategy, self.batch_size, self.mesh, self.axis)

    @property
    def num_shards(self) -> int:
        """How many devices share the participants (1 without a mesh)."""
        return 1 if self.mesh is None else int(self.mesh.shape[self.axis])


def mesh_client_map(
    devices=None, *, strategy: str | None = None, batch_size: int | None = None, axis: str = CLIENT_AXIS
) -> ClientMap:
    """A :class:`ClientMap` that splits the participants over ``devices``.

    Args:
      devices: the devices (default: ``jax.devices()``, every device of every process), or their number
        (the first that many of ``jax.devices()``).
      strategy: how each device runs its share (:class:`ClientMap`).
      batch_size: with ``"map"``, vmap this many clients per map step on each device (:class:`ClientMap`).
      axis: the mesh axis's name.

    Raises:
      ValueError: no devices, or more than there are.
    """
    available = jax.devices()
    if devices is None:
        devices = available
    elif isinstance(devices, int | np.integer) and not isinstance(devices, bool):
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices} but this run has {len(available)} device(s) ({jax.default_backend()}); "
                "on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax starts) "
                "simulates N devices"
            )
        devices = available[:devices]
    devices = list(devices)
    if not devices:
        raise ValueError("devices is empty: pass None (every device), a count, or a list of devices")
    return ClientMap(strategy, batch_size, Mesh(np.asarray(devices), (axis,)), axis).resolved()


def as_client_map(client_map) -> ClientMap:
    """``None`` (backend default), a strategy name, or a :class:`ClientMap`, resolved."""
    if client_map is None or isinstance(client_map, str):
        client_map = ClientMap(client_map)
    if not isinstance(client_map, ClientMap):
        raise TypeError(f"client_map must be None, 'vmap', 'map' or a ClientMap, got {client_map!r}")
    return client_map.resolved()


def _shard_map(f, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` (jax >= 0.7), or ``jax.experimental.shard_map`` on older jax."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # jax < 0.7

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _spec(cmap: ClientMap, split: bool):
    return jax.sharding.NamedSharding(cmap.mesh, PartitionSpec(cmap.axis) if split else PartitionSpec())


def _constrain(cmap: ClientMap, tree: PyTree, split: bool) -> PyTree:
    """``tree`` pinned to the client axis (``split``) or replicated; unchanged without a mesh."""
    if cmap.mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, _spec(cmap, split))


def _pad_participants(cmap: ClientMap, ids: jax.Array) -> jax.Array:
    """``ids`` padded to a multiple of the devices on the client axis with copies of ``ids[0]`` (whose
    results are dropped); unchanged without a mesh. Refuses more devices than participants."""
    num, shards = ids.shape[0], cmap.num_shards
    if shards > num:
        raise ValueError(
            f"client_map splits the participants over {shards} devices but a round has only {num} "
            f"participant(s): use at most {num} devices (sidejax.fl.mesh_client_map({num})) or more "
            "clients per round"
        )
    pad = -num % shards
    return jnp.concatenate([ids, jnp.repeat(ids[:1], pad)]) if pad else ids


def _map_clients(cmap: ClientMap, one_client, args: PyTree, shared: PyTree) -> PyTree:
    """``one_client(participant_args, shared)`` over the leading (participants) axis of ``args``.

    Without a mesh: ``jax.vmap`` or ``jax.lax.map`` on one device. With one (``args`` already padded to a
    multiple of the devices, :func:`_pad_participants`): ``shard_map`` splits the participants into
    contiguous shares over ``cmap.axis``, each device maps its share the same way, and ``shared`` is
    replicated."""

    def local(a, sh):
        if cmap.strategy == "vmap":
            return jax.vmap(one_client, (0, None))(a, sh)
        return jax.lax.map(lambda p: one_client(p, sh), a, batch_size=cmap.batch_size)

    if cmap.mesh is None:
        return local(args, shared)
    split, whole = PartitionSpec(cmap.axis), PartitionSpec()
    return _shard_map(local, cmap.mesh, in_specs=(split, whole), out_specs=split)(args, shared)


def client_state_split(client_map: ClientMap, num_clients: int) -> bool:
    """Whether the engine spreads the per-client state over ``client_map``'s client axis: with a mesh whose
    client axis divides ``num_clients`` (a sharded array's axis must divide evenly). Otherwise every device
    holds all of it (replicated)."""
    return client_map.mesh is not None and num_clients % client_map.num_shards == 0


def _host(leaf) -> np.ndarray:
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return np.asarray(leaf)
    if leaf.is_fully_replicated:
        return np.asarray(leaf.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))


def _on_key_data(fn, leaf):
    """``fn(leaf)``, or for a typed PRNG key array ``fn`` of its key data, wrapped again as keys."""
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(fn(jax.random.key_data(leaf)), impl=jax.random.key_impl(leaf))
    return fn(leaf)


def gather_to_host(tree: PyTree) -> PyTree:
    """Every leaf of ``tree`` as a NumPy array holding its whole value, in every process (what a checkpoint
    or an evaluation needs). A leaf split over devices of other processes is all-gathered (a collective:
    every process must call this together); typed PRNG keys are kept as key data and wrapped again."""
    return jax.tree.map(lambda leaf: _on_key_data(_host, leaf), tree)


def _place(value, sharding) -> jax.Array:
    host = _host(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_federation(
    client_map: ClientMap | str | None, state: RoundState, data
) -> tuple[RoundState, PyTree]:
    """Puts a run's state and federation on ``client_map``'s devices, for :func:`run_rounds`.

    Without a mesh it returns its inputs unchanged. With one:

    - the federation's examples ``data.x``/``data.y`` are split over the client axis in contiguous row
      ranges (padded with zero rows to a multiple of the devices; no client index points at them), so each
      device holds ``1/devices`` of them. Each round gathers the participants' own rows to the device that
      runs them; ``client_indices`` and ``num_examples`` (small) are replicated;
    - the per-client state is split over the client axis when the devices divide ``num_clients``
      (:func:`client_state_split`): client ``c``'s state lives on device ``c // (num_clients / devices)``.
      Otherwise it is replicated;
    - the server state and the round counter are replicated.

    Every process of a multi-process run calls it with the same values (each places only the shards of its
    own devices, from ``jax.make_array_from_callback``). Placement changes where values live, not what they
    are: a placed run equals the unplaced one (same bits; server state within a few ULP, as for any mesh).

    Returns:
      ``(state, data)`` placed.
    """
    cmap = as_client_map(client_map)
    if cmap.mesh is None:
        return state, data
    check_federation(state, data)
    num_clients = int(data.num_examples.shape[0])
    whole, split = _spec(cmap, False), _spec(cmap, True)

    def rows(a):
        a = _host(a)
        pad = -a.shape[0] % cmap.num_shards
        if pad:
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
        return _place(a, split)

    def leaf(a, sharding):
        return _on_key_data(lambda v: _place(v, sharding), a)

    clients = split if client_state_split(cmap, num_clients) else whole
    placed_state = RoundState(
        round_index=leaf(state.round_index, whole),
        server=jax.tree.map(lambda a: leaf(a, whole), state.server),
        clients=jax.tree.map(lambda a: leaf(a, clients), state.clients),
        num_clients=None if state.num_clients is None else leaf(state.num_clients, whole),
    )
    placed_data = data._replace(
        x=rows(data.x),
        y=rows(data.y),
        client_indices=leaf(data.client_indices, whole),
        num_examples=leaf(data.num_examples, whole),
    )
    return placed_state, placed_data


class ClientPhase(NamedTuple):
    """Steps 1-3 of a round (``build_round_step(...).client_phase``): what the server receives.

    Attributes:
      client_ids: int32 ``[clients_per_round]``, the participants, ascending.
      keys: their :class:`sidejax.keys.ClientKeys` (stacked).
      sent_server: the server state after its broadcast (what ``server_update`` sees).
      downlink: the downlink :class:`sidejax.coding.Message` (shared, or stacked per participant).
      messages: the uplink messages, stacked over participants.
      client_states: the participants' new client states, stacked.
      client_info: their :class:`ClientInfo`, stacked.
      counts: int32 ``[clients_per_round]``, their example counts (the server's weights).
    """

    client_ids: jax.Array
    keys: PyTree
    sent_server: PyTree
    downlink: PyTree
    messages: PyTree
    client_states: PyTree
    client_info: ClientInfo
    counts: jax.Array


class PartialRound(NamedTuple):
    """A round whose participants run in parts (:func:`start_round`, :func:`run_clients`,
    :func:`finish_round`): the round's sampling and downlink, done once, and the participants' results so far.

    Attributes:
      clients_done: int32 ``[]``, how many participants (the first ones, in ``client_ids`` order) have run.
      phase: the round's :class:`ClientPhase` with ``keys=None`` (they are derived again at the end); the
        rows of the participants not yet run are zeros.
    """

    clients_done: jax.Array
    phase: ClientPhase


# --- the round's three roles: one definition, for the engine here and for transports (sidejax.fl.roles) -----


def draw_participants(algorithm: Algorithm, rkey: PRNGKey, num_clients: int) -> jax.Array:
    """Step 1 of a round: its participants, sampled from ``stream_key(rkey, SAMPLING)`` (every party can
    compute them from the round key)."""
    return sample_clients(stream_key(rkey, SAMPLING), num_clients, algorithm.clients_per_round)


def open_downlink(algorithm: Algorithm, rkey: PRNGKey, server: PyTree, num_clients: int):
    """Steps 1-2 of a round, the server's opening: ``(client_ids, sent_server, downlink)`` for the round
    whose key is ``rkey`` (:func:`draw_participants`, then the broadcast keyed by
    ``stream_key(rkey, DOWNLINK)``)."""
    ids = draw_participants(algorithm, rkey, num_clients)
    sent_server, downlink = algorithm.broadcast(stream_key(rkey, DOWNLINK), server, ids)
    return ids, sent_server, downlink


def participate(
    algorithm: Algorithm, dkey: PRNGKey, keys, server: PyTree, client_state: PyTree, message, data
):
    """Step 3 for one participant: ``receive`` its downlink ``message`` against ``server`` (the server state
    before the broadcast, or a client's view of it) and its own ``client_state``, then ``client_update``
    with its keys and ``data`` (a :class:`ClientData` or its four fields). Returns ``(client_state,
    uplink message, ClientInfo)``."""
    received = algorithm.receive(dkey, keys, server, client_state, message)
    return algorithm.client_update(keys, received, client_state, ClientData(*data))


def close_round(algorithm: Algorithm, rkey: PRNGKey, round_index, phase: ClientPhase):
    """Step 4 of a round, the server's closing: ``server_update`` on the participants' messages (a stream
    whose sender's ``ClientInfo`` says invalid or not finite is withheld) and the round's
    :class:`RoundInfo`. Returns ``(server, info)``; ``phase.keys`` must hold the participants' keys."""
    ids, messages, downlink = phase.client_ids, phase.messages, phase.downlink
    cinfo = phase.client_info
    # what a client knows is wrong reaches the server in its message: the stream is withheld
    sent = cinfo.valid & jnp.broadcast_to(jnp.asarray(cinfo.finite, bool), ids.shape)
    server, sinfo, errors = algorithm.server_update(
        rkey,
        phase.sent_server,
        ids,
        phase.keys.shared,
        withhold(messages, sent),
        phase.counts.astype(jnp.float32),
    )
    errors = jnp.broadcast_to(jnp.asarray(errors, jnp.int32), ids.shape)
    info = RoundInfo(
        round_index=round_index,
        client_ids=ids,
        uplink_bits=jnp.broadcast_to(as_bits(messages.num_bits), ids.shape),
        downlink_bits=jnp.broadcast_to(as_bits(downlink.num_bits), ids.shape),
        clients=phase.client_info,
        server=sinfo,
        server_finite=tree_all_finite(server),
        uplink_errors=errors,
        downlink_shared=jnp.asarray(jnp.ndim(downlink.num_bits) == 0),
        included=sent & (errors == 0),
    )
    return server, info


def build_round_step(algorithm: Algorithm, *, client_map: ClientMap | str | None = None):
    """Builds ``round_step(round_key, state, data) -> (state, info)`` from the algorithm's role kernels.

    Args:
      algorithm: the :class:`sidejax.fl.Algorithm`.
      client_map: how to map the participants (:class:`ClientMap`, a strategy name, or ``None`` for the
        backend's default).

    Returns:
      The round step (its ``client_map`` attribute is the resolved map). It is not jitted: jit it, or call
      it through :func:`run_rounds`. Its ``client_phase(round_key, state, data)`` attribute runs steps 1-3
      alone and returns the :class:`ClientPhase` (the participants' messages themselves, e.g. to compare
      two client maps message by message). The same round in parts (what :func:`start_round`,
      :func:`run_clients` and :func:`finish_round` jit): ``start(round_key, state, data)`` runs steps 1-2 and
      returns an empty :class:`PartialRound`; ``clients(round_key, state, data, partial, num)`` runs the
      next ``num`` participants; ``finish(round_key, state, data, partial)`` runs steps 4-5. A participant's
      work depends only on its own id, keys, state and data, so the parts give the messages of the whole
      round.
    """
    cmap = as_client_map(client_map)
    clients_per_round = algorithm.clients_per_round
    if clients_per_round < 1:
        raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")

    def open_round(rkey: PRNGKey, state: RoundState, data):
        """Steps 1-2: the participants, the server after its broadcast, the downlink."""
        check_federation(state, data)
        return open_downlink(algorithm, rkey, state.server, data.num_examples.shape[0])

    def participants(rkey: PRNGKey, state: RoundState, data, ids, downlink, message):
        """Step 3 for the participants ``ids`` (``message``: their own downlinks, stacked, when the downlink
        is per participant, else ``None``): ``(client states, messages, ClientInfo, keys, counts)``."""
        dkey = stream_key(rkey, DOWNLINK)
        # with a mesh, the participants are padded to a multiple of the devices; the padding is dropped below
        pids = _pad_participants(cmap, ids)
        extra = pids.shape[0] - ids.shape[0]
        keys = jax.vmap(client_keys, (None, 0))(rkey, pids)
        cstates = _take(state.clients, pids)
        counts = data.num_examples[pids]
        if message is not None and extra:
            message = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[:1], extra, 0)]), message)
        # A client reads ClientData(x, y, indices): each of the three is either its own (mapped over the
        # participants) or shared by all, the other slot None.
        idx = data.client_indices[pids]
        if cmap.mesh is None:
            # one device: the federation's examples are shared, each client reads its rows through its indices
            own, whole = (None, None, idx), (data.x, data.y, None)
        else:
            # a mesh: each participant's rows are gathered to the device that runs it (the examples are split
            # over the devices, place_federation); it reads them through local indices 0..max_examples-1
            own = (data.x[idx], data.y[idx], None)
            whole = (None, None, jnp.arange(idx.shape[1], dtype=idx.dtype))

        def one_client(args, shared):
            k, cs, n, msg, mine = args
            dk, server, broadcast, common = shared
            x, y, indices = (a if a is not None else b for a, b in zip(mine, common, strict=True))
            return participate(
                algorithm, dk, k, server, cs, broadcast if msg is None else msg, (x, y, indices, n)
            )

        args = _constrain(cmap, (keys, cstates, counts, message, own), True)
        shared = (dkey, state.server, downlink, whole)
        new_cstates, messages, cinfo = jax.tree.map(
            lambda a: a[: ids.shape[0]], _map_clients(cmap, one_client, args, shared)
        )
        if not isinstance(cinfo, ClientInfo):
            raise TypeError("client_update must return a sidejax.fl.ClientInfo as its third output")
        cinfo = cinfo._replace(
            valid=jnp.broadcast_to(jnp.asarray(cinfo.valid, bool), ids.shape),
            downlink_errors=jnp.broadcast_to(jnp.asarray(cinfo.downlink_errors, jnp.int32), ids.shape),
        )
        keys = jax.tree.map(lambda a: a[: ids.shape[0]], keys)
        return new_cstates, messages, cinfo, keys, counts[: ids.shape[0]]

    def own_downlinks(downlink):
        """The downlink when it is one message per participant (``num_bits[C]``), else ``None``."""
        return downlink if jnp.ndim(downlink.num_bits) == 1 else None

    def client_phase(rkey: PRNGKey, state: RoundState, data) -> ClientPhase:
        ids, sent_server, downlink = open_round(rkey, state, data)
        new_cstates, messages, cinfo, keys, counts = participants(
            rkey, state, data, ids, downlink, own_downlinks(downlink)
        )
        return ClientPhase(ids, keys, sent_server, downlink, messages, new_cstates, cinfo, counts)

    def finish_phase(rkey: PRNGKey, state: RoundState, data, phase: ClientPhase):
        """Steps 4-5: the server's update from the participants' messages, and the round's record."""
        server, info = close_round(algorithm, rkey, state.round_index, phase)
        clients = _put(state.clients, phase.client_ids, phase.client_states)
        split = client_state_split(cmap, data.num_examples.shape[0])
        new_state = RoundState(
            round_index=state.round_index + 1,
            server=_constrain(cmap, server, False),
            clients=_constrain(cmap, clients, split),
            num_clients=state.num_clients,
        )
        # with a mesh, the round's record is replicated: every process can read it
        return new_state, _constrain(cmap, info, False)

    def round_step(rkey: PRNGKey, state: RoundState, data) -> tuple[RoundState, RoundInfo]:
        return finish_phase(rkey, state, data, client_phase(rkey, state, data))

    def start(rkey: PRNGKey, state: RoundState, data) -> PartialRound:
        ids, sent_server, downlink = open_round(rkey, state, data)
        shapes = jax.eval_shape(
            lambda: participants(rkey, state, data, ids, downlink, own_downlinks(downlink))
        )
        new_cstates, messages, cinfo, _, counts = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        phase = ClientPhase(ids, None, sent_server, downlink, messages, new_cstates, cinfo, counts)
        return PartialRound(jnp.zeros((), jnp.int32), phase)

    def clients(rkey: PRNGKey, state: RoundState, data, partial: PartialRound, num: int) -> PartialRound:
        first, phase = partial.clients_done, partial.phase

        def part(a):
            return jax.lax.dynamic_slice_in_dim(a, first, num)

        own = own_downlinks(phase.downlink)
        results = participants(
            rkey,
            state,
            data,
            part(phase.client_ids),
            phase.downlink,
            None if own is None else jax.tree.map(part, own),
        )
        new_cstates, messages, cinfo, _, counts = results
        buffers = (phase.client_states, phase.messages, phase.client_info, phase.counts)
        filled = jax.tree.map(
            lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, first, 0),
            buffers,
            (new_cstates, messages, cinfo, counts),
        )
        phase = phase._replace(
            client_states=filled[0], messages=filled[1], client_info=filled[2], counts=filled[3]
        )
        return PartialRound(first + num, phase)

    def finish(rkey: PRNGKey, state: RoundState, data, partial: PartialRound):
        keys = jax.vmap(client_keys, (None, 0))(rkey, partial.phase.client_ids)
        return finish_phase(rkey, state, data, partial.phase._replace(keys=keys))

    round_step.client_phase = client_phase
    round_step.start = start
    round_step.clients = clients
    round_step.finish = finish
    round_step.client_map = cmap
    return round_step


@functools.partial(jax.jit, static_argnames=("algorithm", "num_rounds", "client_map"))
def _run_rounds(
    algorithm: Algorithm, base_key: PRNGKey, state: RoundState, data, num_rounds: int, client_map: ClientMap
):
    round_step = build_round_step(algorithm, client_map=client_map)

    def body(st, _):
        rkey = round_key(base_key, st.round_index)
        return round_step(rkey, st, data)

    return jax.lax.scan(body, state, None, length=num_rounds)


def run_rounds(
    algorithm: Algorithm,
    base_key: PRNGKey,
    state: RoundState,
    data,
    num_rounds: int,
    *,
    client_map: ClientMap | str | None = None,
) -> tuple[RoundState, RoundInfo]:
    """Runs ``num_rounds`` rounds with ``lax.scan`` under one ``jit``.

    Round ``t = state.round_index + s`` (``s = 0..num_rounds-1``) uses ``round_key(base_key, t)``.

    Args:
      algorithm: the :class:`sidejax.fl.Algorithm` (static: its functions are part of the compiled program).
      base_key: the run's key (typed ``jax.random.key``).
      state: the :class:`sidejax.fl.RoundState` to start from.
      data: a :class:`sidejax.data.FederatedData` (an argument, not a closure, so it is not baked in).
      num_rounds: rounds in this call (static; each distinct value compiles once).
      client_map: how the participants are mapped (:class:`ClientMap`, ``"vmap"``, ``"map"``, or ``None``
        for the backend's default; static).

    Returns:
      ``(final_state, infos)`` with every :class:`RoundInfo` leaf stacked along a leading rounds axis.

    Raises:
      ValueError: if ``data`` holds another number of clients than ``state`` was initialised for
        (:func:`check_federation`, on the host before compiling).
    """
    check_federation(state, data)
    return _run_rounds(algorithm, base_key, state, data, num_rounds, as_client_map(client_map))


run_rounds._cache_size = _run_rounds._cache_size  # compilations so far (tests check chunks do not recompile)


# --- one round in parts -------------------------------------------------------------------------------------


def _step_of(algorithm: Algorithm, base_key: PRNGKey, state: RoundState, client_map: ClientMap):
    return build_round_step(algorithm, client_map=client_map), round_key(base_key, state.round_index)


@functools.partial(jax.jit, static_argnames=("algorithm", "client_map"))
def _start_round(algorithm, base_key, state, data, client_map):
    step, rkey = _step_of(algorithm, base_key, state, client_map)
    return step.start(rkey, state, data)


@functools.partial(jax.jit, static_argnames=("algorithm", "num_clients", "client_map"))
def _run_clients(algorithm, base_key, state, data, partial, num_clients, client_map):
    step, rkey = _step_of(algorithm, base_key, state, client_map)
    return step.clients(rkey, state, data, partial, num_clients)


@functools.partial(jax.jit, static_argnames=("algorithm", "client_map"))
def _finish_round(algorithm, base_key, state, data, partial, client_map):
    step, rkey = _step_of(algorithm, base_key, state, client_map)
    return step.finish(rkey, state, data, partial)


def start_round(
    algorithm: Algorithm, base_key: PRNGKey, state: RoundState, data, *, client_map=None
) -> PartialRound:
    """Starts round ``state.round_index`` in parts: samples its participants and runs its downlink
    (steps 1-2 of :func:`build_round_step`); no participant has run yet.

    A long client phase (BPC-FL's one round: every client pretrains expert trajectories and learns its
    pseudocoreset) then runs in parts of a few participants (:func:`run_clients`), each part's
    :class:`PartialRound` a value the caller may checkpoint and resume from, and :func:`finish_round` runs
    the server's update once every participant has run. The parts give the round of :func:`run_rounds`:
    every participant's keys derive from its global id and the round key, as in one go, so its messages are
    the same bits (with ``"map"``, the CPU default, each client runs alone either way; with ``"vmap"`` a
    part changes the batch width, which on an accelerator may change the last bits of a client's floats).
    The arguments are those of :func:`run_rounds`.
    """
    check_federation(state, data)
    return _start_round(algorithm, base_key, state, data, as_client_map(client_map))


def run_clients(
    algorithm: Algorithm,
    base_key: PRNGKey,
    state: RoundState,
    data,
    partial: PartialRound,
    num_clients: int,
    *,
    client_map=None,
) -> PartialRound:
    """Runs the next ``num_clients`` participants of the round that ``partial`` holds
    (:func:`start_round`), from participant ``partial.clients_done`` on, and returns the partial round with
    their results in place. ``num_clients`` is static (each value compiles once).

    Raises:
      ValueError: ``num_clients`` is not in ``[1, participants left]`` (checked when ``partial`` is
        concrete), or ``data`` is not ``state``'s federation.
    """
    check_federation(state, data)
    total = int(partial.phase.client_ids.shape[0])
    left = total - int(partial.clients_done) if is_concrete(partial.clients_done) else total
    if not isinstance(num_clients, int | np.integer) or not 1 <= num_clients <= left:
        raise ValueError(
            f"num_clients must be an int in [1, {left}] (the round's participants not yet run), got "
            f"{num_clients!r}"
        )
    return _run_clients(
        algorithm, base_key, state, data, partial, int(num_clients), as_client_map(client_map)
    )


def finish_round(
    algorithm: Algorithm,
    base_key: PRNGKey,
    state: RoundState,
    data,
    partial: PartialRound,
    *,
    client_map=None,
) -> tuple[RoundState, RoundInfo]:
    """Ends the round that ``partial`` holds once every participant has run (:func:`run_clients`): the
    server's update and the write-back, steps 4-5 of :func:`build_round_step`. Returns ``(state, info)``
    like one round of :func:`run_rounds` (``info`` without the rounds axis).

    Raises:
      ValueError: some participants have not run (checked when ``partial`` is concrete).
    """
    check_federation(state, data)
    total = int(partial.phase.client_ids.shape[0])
    if is_concrete(partial.clients_done) and int(partial.clients_done) != total:
        raise ValueError(
            f"finish_round: {int(partial.clients_done)} of the round's {total} participants have run; run "
            f"the rest with run_clients first"
        )
    return _finish_round(algorithm, base_key, state, data, partial, as_client_map(client_map))
