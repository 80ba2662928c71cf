"""The round engine (sidejax.fl.rounds): scan vs a loop of rounds, resumption and determinism bit for bit,
the client map, the downlink (shared or one message per participant), the keys and weights the server gets,
client sampling, and the federation checks. FedAvg (conftest ``fedavg_map``) is the workload where one is
needed; a hand-written algorithm checks the engine's plumbing exactly."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import BASE, assert_trees_close_across_programs, tree_equal
from jax.flatten_util import ravel_pytree

from sidejax.algorithms import fedavg, fedpm, qlsd, qsgd, sgld, signsgd
from sidejax.coding import Message, float32_coder
from sidejax.fl import (
    Algorithm,
    ClientInfo,
    ClientMap,
    Evaluation,
    LocalTraining,
    as_client_map,
    build_round_step,
    default_client_strategy,
    finish_round,
    initial_round_state,
    run_clients,
    run_rounds,
    sample_clients,
    start_round,
)
from sidejax.keys import client_keys, round_key


def test_cross_program_tolerance_is_tight():
    w = np.linspace(-0.5, 1.0, 101, dtype=np.float32)
    one_ulp = np.nextafter(w, np.float32(2.0))
    assert_trees_close_across_programs({"w": one_ulp, "ids": np.arange(3)}, {"w": w, "ids": np.arange(3)}, 16)
    off = w.copy()
    off[7] += 20 * np.spacing(np.float32(1.0))  # 20 ULPs of the leaf's scale
    with pytest.raises(AssertionError):
        assert_trees_close_across_programs({"w": off}, {"w": w}, 16)
    with pytest.raises(AssertionError):
        assert_trees_close_across_programs({"ids": np.array([0, 2])}, {"ids": np.array([0, 1])}, 16)


def test_scan_equals_python_loop_of_rounds(fedavg_map, small_model, digits_fed):
    _, params, _ = small_model
    state = fedavg_map.init(BASE, params, 10)
    step = jax.jit(build_round_step(fedavg_map, client_map="map"))
    infos = []
    for t in range(3):
        state, info = step(round_key(BASE, t), state, digits_fed)
        infos.append(info)
    scanned, sinfos = run_rounds(
        fedavg_map, BASE, fedavg_map.init(BASE, params, 10), digits_fed, 3, client_map="map"
    )
    # The jitted round called from Python and the scan of it are two compiled programs: a few ULP apart at
    # most (bit-equal on this machine); client ids, step counts and bit counts exactly equal.
    assert_trees_close_across_programs(state, scanned, ulps=16)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *infos)
    assert_trees_close_across_programs(stacked, sinfos, ulps=16)
    np.testing.assert_array_equal(stacked.uplink_bits, sinfos.uplink_bits)


def test_five_plus_five_rounds_equal_ten_bit_for_bit(fedavg_map, digits_fed, fedavg_ten_rounds):
    state0, (final10, info10) = fedavg_ten_rounds
    mid, info_a = run_rounds(fedavg_map, BASE, state0, digits_fed, 5, client_map="map")
    final, info_b = run_rounds(fedavg_map, BASE, mid, digits_fed, 5, client_map="map")
    assert tree_equal(final, final10)
    both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), info_a, info_b)
    assert tree_equal(both, info10)


def test_same_seed_same_bits_and_second_chunk_does_not_recompile(fedavg_map, digits_fed, fedavg_ten_rounds):
    state0, (final10, info10) = fedavg_ten_rounds
    # the fixture may have run in another module (compiled executables are released between modules,
    # conftest._release_compiled_programs), so this call may compile once; the next ones must not
    again, info_again = run_rounds(fedavg_map, BASE, state0, digits_fed, 10, client_map="map")
    before = run_rounds._cache_size()
    again2, _ = run_rounds(fedavg_map, BASE, state0, digits_fed, 10, client_map="map")
    assert run_rounds._cache_size() == before
    assert tree_equal(again, final10) and tree_equal(info_again, info10) and tree_equal(again2, again)
    # the same map given another way (a ClientMap equal to the resolved "map") is the same program
    run_rounds(fedavg_map, BASE, state0, digits_fed, 10, client_map=ClientMap("map"))
    assert run_rounds._cache_size() == before
    other, _ = run_rounds(fedavg_map, jax.random.key(7), state0, digits_fed, 10, client_map="map")
    assert not tree_equal(other.server.params, final10.server.params)


def test_a_round_in_parts_equals_the_round_in_one_go(fedavg_map, digits_fed, fedavg_ten_rounds):
    """start_round, run_clients in parts of 3 and 1 participants (the second size compiles once more),
    finish_round: the round of run_rounds. Every participant's messages and client info are the same bits
    (each client runs alone under "map", with its own keys); the server's update is another compiled program,
    within a few ULP (bit-equal on this machine)."""
    state0, _ = fedavg_ten_rounds
    one, one_info = run_rounds(fedavg_map, BASE, state0, digits_fed, 1, client_map="map")
    phase = jax.jit(build_round_step(fedavg_map, client_map="map").client_phase)(
        round_key(BASE, 0), state0, digits_fed
    )
    partial = start_round(fedavg_map, BASE, state0, digits_fed, client_map="map")
    assert int(partial.clients_done) == 0
    for num in (3, 1):
        partial = run_clients(fedavg_map, BASE, state0, digits_fed, partial, num, client_map="map")
    assert int(partial.clients_done) == 4
    assert tree_equal(partial.phase._replace(keys=None), phase._replace(keys=None))
    state, info = finish_round(fedavg_map, BASE, state0, digits_fed, partial, client_map="map")
    assert_trees_close_across_programs(state, one, ulps=16)
    assert_trees_close_across_programs(jax.tree.map(lambda a: a[None], info), one_info, ulps=16)
    np.testing.assert_array_equal(info.uplink_bits, one_info.uplink_bits[0])


def test_a_round_in_parts_refuses_a_bad_part(fedavg_map, digits_fed, fedavg_ten_rounds):
    state0, _ = fedavg_ten_rounds
    partial = start_round(fedavg_map, BASE, state0, digits_fed, client_map="map")
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="num_clients must be an int in \\[1, 4\\]"):
            run_clients(fedavg_map, BASE, state0, digits_fed, partial, bad, client_map="map")
    with pytest.raises(ValueError, match="0 of the round's 4 participants have run"):
        finish_round(fedavg_map, BASE, state0, digits_fed, partial, client_map="map")


def test_client_maps_agree(fedavg_map, small_model, digits_fed):
    """``vmap``, ``map`` and ``map`` with ``batch_size`` clients per step are different compiled programs
    for the same round: float results agree to rounding, ids and bit counts exactly."""
    _, params, _ = small_model
    state = fedavg_map.init(BASE, params, 10)
    runs = {
        cmap: run_rounds(fedavg_map, BASE, state, digits_fed, 2, client_map=cmap)
        for cmap in (ClientMap("map"), ClientMap("vmap"), ClientMap("map", batch_size=3))
    }
    (sa, ia), *others = runs.values()
    for sb, ib in others:
        np.testing.assert_allclose(
            ravel_pytree(sa.server.params)[0], ravel_pytree(sb.server.params)[0], rtol=0, atol=1e-5
        )
        np.testing.assert_array_equal(ia.client_ids, ib.client_ids)
        np.testing.assert_allclose(ia.clients.loss, ib.clients.loss, rtol=1e-5)
        np.testing.assert_array_equal(ia.clients.extra, ib.clients.extra)  # local steps
        np.testing.assert_array_equal(ia.uplink_bits, ib.uplink_bits)
        np.testing.assert_array_equal(ia.downlink_bits, ib.downlink_bits)


def test_client_map_is_resolved_once_and_checked(fedavg_map, small_model, digits_fed):
    assert as_client_map(None) == ClientMap(default_client_strategy(), None)
    assert as_client_map("vmap") == ClientMap("vmap", None)
    assert as_client_map(ClientMap("map", 4)) == ClientMap("map", 4)
    assert build_round_step(fedavg_map, client_map=ClientMap("map", 2)).client_map == ClientMap("map", 2)
    with pytest.raises(ValueError, match=r"client_map.strategy must be one of \('vmap', 'map'\), got 'pmap'"):
        build_round_step(fedavg_map, client_map="pmap")
    with pytest.raises(ValueError, match="client_map.batch_size must be None or >= 1, got 0"):
        as_client_map(ClientMap("map", 0))
    with pytest.raises(TypeError, match="client_map must be None, 'vmap', 'map' or a ClientMap"):
        as_client_map(("map", 2))
    _, params, _ = small_model
    with pytest.raises(ValueError, match="client_map.strategy"):
        run_rounds(fedavg_map, BASE, fedavg_map.init(BASE, params, 10), digits_fed, 1, client_map="serial")


def test_client_strategy_defaults_to_map_on_cpu_and_vmap_on_accelerators(small_model, monkeypatch):
    """The client map is the engine's choice, resolved in one place (default_client_strategy): "map" on CPU
    (memory for one client at a time), "vmap" on GPU/TPU; no algorithm builder takes it."""
    _, _, loss = small_model
    common = dict(clients_per_round=2)
    lang = dict(num_clients=10, clients_per_round=2)
    algorithms = [
        fedavg(loss, LocalTraining(optax.sgd(0.1), batch_size=8), **common),
        fedpm(loss, LocalTraining(optax.adam(0.1), batch_size=8), **common),
        qsgd(loss, LocalTraining(optax.sgd(0.1), batch_size=8), **common),
        signsgd(loss, LocalTraining(optax.sgd(0.1), batch_size=8), **common),
        qlsd(loss, **lang),
        sgld(loss, coder=float32_coder(), **lang),
    ]
    expected = "map" if jax.default_backend() == "cpu" else "vmap"
    assert default_client_strategy() == expected
    assert all(build_round_step(a).client_map == ClientMap(expected) for a in algorithms)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert default_client_strategy() == "vmap"
    assert all(build_round_step(a).client_map.strategy == "vmap" for a in algorithms)
    assert as_client_map(None).strategy == "vmap"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert all(build_round_step(a).client_map.strategy == "map" for a in algorithms)
    assert build_round_step(algorithms[0], client_map="vmap").client_map.strategy == "vmap"


def test_sample_clients_without_replacement_and_uniform():
    n, c, trials = 20, 5, 4000
    keys = jax.random.split(jax.random.key(3), trials)
    ids = np.asarray(jax.jit(jax.vmap(lambda k: sample_clients(k, n, c)))(keys))
    assert all(len(set(row)) == c for row in ids)
    assert (np.diff(ids, axis=1) > 0).all() and ids.min() >= 0 and ids.max() < n
    freq = np.bincount(ids.ravel(), minlength=n) / trials  # each client: Binomial(trials, c/n) / trials
    p = c / n
    se = np.sqrt(p * (1 - p) / trials)
    assert np.abs(freq - p).max() < 5 * se
    with pytest.raises(ValueError, match="clients_per_round"):
        sample_clients(jax.random.key(0), 3, 4)


def test_state_for_another_number_of_clients_is_refused(fedavg_map, small_model, digits_fed):
    """init for 7 clients, then 10-client data: before, run_rounds silently sampled clients 7-9."""
    _, params, _ = small_model
    state = fedavg_map.init(BASE, params, 7)
    assert int(state.num_clients) == 7
    with pytest.raises(ValueError, match=r"num_clients=7 but the data has 10 clients"):
        run_rounds(fedavg_map, BASE, state, digits_fed, 1, client_map="map")
    round_step = build_round_step(fedavg_map, client_map="map")
    with pytest.raises(ValueError, match=r"num_clients=7 but the data has 10 clients"):
        round_step(round_key(BASE, 0), state, digits_fed)  # eager call: checked too
    # a per-client state is checked by its (static) leading axis, also under jit
    stacked = state._replace(clients=jnp.zeros((7, 3)), num_clients=None)
    with pytest.raises(ValueError, match=r"stacked over 7 clients but the data has 10"):
        jax.jit(round_step)(round_key(BASE, 0), stacked, digits_fed)
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        fedavg_map.init(BASE, params, 0)
    # the matching federation runs, and num_clients is carried through the rounds
    final, _ = run_rounds(
        fedavg_map, BASE, fedavg_map.init(BASE, params, 10), digits_fed, 1, client_map="map"
    )
    assert int(final.num_clients) == 10


def test_clients_per_round_is_checked_when_the_round_is_built(small_model):
    _, _, loss = small_model
    with pytest.raises(ValueError, match="clients_per_round must be >= 1, got 0"):
        build_round_step(fedavg(loss, LocalTraining(optax.sgd(0.1), batch_size=4), clients_per_round=0))


# ----------------------------------------------------------------------------------------------------
# the engine's plumbing, exactly: a hand-written algorithm whose every output records what it was given


class EchoServer(NamedTuple):
    secrets: jax.Array  # int32 [num_clients]: the value each client must receive this round
    sent: jax.Array  # int32: downlinks sent so far (broadcast's record; server_update must see it)


class EchoServerInfo(NamedTuple):
    shared_key_data: jax.Array  # the shared keys server_update was given, as key data [clients, 2]
    echoed: jax.Array  # the values the participants sent back, decoded from their messages
    weights: jax.Array
    sent: jax.Array  # server.sent as server_update saw it


def echo_algorithm(clients_per_round: int) -> Algorithm:
    """Client ``i`` must receive its own secret ``1000 + 7 i + t`` (round ``t``) in a downlink message of its
    own, ``i + 1`` words (``32 (i + 1)`` bits, a different length per participant), and echoes what it
    decoded on the uplink; the server reports the keys and weights it was given and what was echoed."""

    def init(key, params, num_clients):
        del key, params
        secrets = 1000 + 7 * jnp.arange(num_clients, dtype=jnp.int32)
        heard = jnp.zeros(num_clients, jnp.int32)  # per client: downlinks it has received
        return initial_round_state(EchoServer(secrets, jnp.int32(0)), heard, num_clients)

    def broadcast(dkey, server, ids):
        del dkey
        n = server.secrets.shape[0]
        value = server.secrets[ids].astype(jnp.uint32)
        words = jnp.where(jnp.arange(n)[None, :] <= ids[:, None], value[:, None], jnp.uint32(0))
        message = Message(words, 32.0 * (ids + 1).astype(jnp.float32))  # payload [clients, n], bits [clients]
        return server._replace(sent=server.sent + 1), message

    def receive(dkey, keys, server, heard, message):
        del dkey, keys, server  # everything this client learns is in its message (and its own memory)
        words = message.payload
        used = jnp.arange(words.shape[0]) * 32 < message.num_bits
        intact = jnp.all(jnp.where(used, words == words[0], words == 0))
        return words[0].astype(jnp.int32), message.num_bits, intact, heard

    def client_update(keys, received, state, data):
        del keys, data
        value, bits, intact, heard = received
        uplink = Message(value.astype(jnp.uint32)[None], jnp.float32(32.0))
        info = ClientInfo(
            loss=jnp.float32(0.0), finite=intact, extra=(value, bits, heard), valid=value % 2 == 0
        )
        return state + 1, uplink, info

    def server_update(rkey, server, ids, shared_keys, messages, weights):
        del rkey
        info = EchoServerInfo(
            jax.random.key_data(shared_keys), messages.payload[:, 0].astype(jnp.int32), weights, server.sent
        )
        return EchoServer(server.secrets + 1, server.sent), info, (ids % 3).astype(jnp.int32)

    return Algorithm(
        init=init,
        broadcast=broadcast,
        receive=receive,
        client_update=client_update,
        server_update=server_update,
        evaluation=Evaluation(lambda state: state.server.secrets),
        clients_per_round=clients_per_round,
    )


ECHO = echo_algorithm(clients_per_round=4)
ECHO_MAPS = (ClientMap("vmap"), ClientMap("map"), ClientMap("map", batch_size=3))


@pytest.fixture(scope="module")
def echo_runs(digits_fed):
    state = ECHO.init(BASE, None, 10)
    return {cmap: run_rounds(ECHO, BASE, state, digits_fed, 3, client_map=cmap) for cmap in ECHO_MAPS}


@pytest.mark.parametrize("cmap", ECHO_MAPS, ids=str)
def test_a_per_participant_downlink_reaches_each_participant(echo_runs, cmap):
    """A downlink with ``num_bits[clients]`` is one message per participant: participant ``i`` decodes its
    own (``algorithm.receive`` sees only that slice), and ``RoundInfo.downlink_bits`` is each message's
    length, under every client map."""
    final, info = echo_runs[cmap]
    ids = np.asarray(info.client_ids)
    rounds = np.arange(3)[:, None]
    assert ids.shape == (3, 4) and len({tuple(r) for r in ids}) > 1  # different participants per round
    value, bits, heard = (np.asarray(a) for a in info.clients.extra)
    np.testing.assert_array_equal(value, 1000 + 7 * ids + rounds)  # its own secret, not a neighbour's
    np.testing.assert_array_equal(bits, 32.0 * (ids + 1))
    assert np.asarray(info.clients.finite).all()  # every used word carried the value, the rest were zero
    np.testing.assert_array_equal(info.downlink_bits, 32.0 * (ids + 1))
    np.testing.assert_array_equal(info.server.echoed, value)  # the uplink carried what each one decoded
    np.testing.assert_array_equal(info.uplink_bits, 32.0)
    np.testing.assert_array_equal(info.clients.valid, value % 2 == 0)  # per-participant flags, in id order
    np.testing.assert_array_equal(info.uplink_errors, ids % 3)  # the server's error masks, in id order
    np.testing.assert_array_equal(final.server.secrets, 1003 + 7 * np.arange(10))
    # receive sees the participant's own client state (how often it was chosen before), and the state
    # written back is the one client_update returned
    before = np.array([[(ids[:t] == i).sum() for i in ids[t]] for t in range(3)])
    np.testing.assert_array_equal(heard, before)
    np.testing.assert_array_equal(final.clients, np.bincount(ids.ravel(), minlength=10))
    # server_update sees the state broadcast returned (its record of what it sent)
    np.testing.assert_array_equal(info.server.sent, [1, 2, 3])


@pytest.mark.parametrize("cmap", ECHO_MAPS, ids=str)
def test_server_update_gets_the_participants_shared_keys_and_example_counts(echo_runs, digits_fed, cmap):
    """The engine derives the participants' shared keys once and hands them to ``server_update`` (the server
    never re-derives the key schedule): entry ``i`` is ``client_keys(round_key(base, t), client_ids[i])
    .shared``; the weights are the participants' example counts."""
    _, info = echo_runs[cmap]
    ids = np.asarray(info.client_ids)
    counts = np.asarray(digits_fed.num_examples)
    for t in range(3):
        rk = round_key(BASE, t)
        want = np.stack([np.asarray(jax.random.key_data(client_keys(rk, int(i)).shared)) for i in ids[t]])
        np.testing.assert_array_equal(np.asarray(info.server.shared_key_data[t]), want)
        np.testing.assert_array_equal(info.server.weights[t], counts[ids[t]].astype(np.float32))
    assert len(np.unique(np.asarray(info.server.shared_key_data).reshape(-1, 2), axis=0)) == 12
