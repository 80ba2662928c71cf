"""sidejax.flower: the envelope, the parties' fault paths over the loopback transport, and the Flower apps in
both runtimes (a SuperLink and SuperNodes on 127.0.0.1; Flower's simulation runtime), checked against the
engine's run_rounds message by message."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fl"))

from roles_family import federation, model, parties  # noqa: E402

from sidejax.coding import ERR_CRC, Message  # noqa: E402
from sidejax.coding.wire import message_to_bytes  # noqa: E402
from sidejax.flower import (  # noqa: E402
    DOWNLINK,
    ENVELOPE_BYTES,
    NOTICE,
    OVERHEAD_BYTES,
    UPLINK,
    WITHHELD,
    EnvelopeError,
    RoundFailedError,
    config_fingerprint,
    loopback_round,
    open_envelope,
    seal,
    tree_from_bytes,
    tree_to_bytes,
)

FP = config_fingerprint({"seed": 0})


def _message(num_bits: int, capacity: int = 4) -> Message:
    rng = np.random.default_rng(num_bits)
    words = rng.integers(0, 2**32, capacity, dtype=np.uint64).astype(np.uint32)
    words[-(-num_bits // 32) :] = 0
    if num_bits % 32:
        words[num_bits // 32] = rng.integers(0, 2 ** (num_bits % 32))
    return Message(words, np.int32(num_bits))


def test_envelope_carries_the_stream_and_refuses_what_it_should():
    """A sealed message opens to the same words (padded to its capacity) and costs 44 + ceil(bits / 8)
    bytes; a flipped byte is caught by the CRC (corrupt), another fingerprint, version, round, kind or a
    truncated buffer is refused by name; withheld uplinks and round notices are 36 bytes."""
    msg = _message(77)
    env = seal(UPLINK, msg, round_index=5, client_id=2, fingerprint=FP, error_bits=3)
    assert len(env) == OVERHEAD_BYTES + 10 and OVERHEAD_BYTES == ENVELOPE_BYTES + 8 == 44
    opened = open_envelope(env, fingerprint=FP, round_index=5)
    assert (opened.kind, opened.round_index, opened.client_id, opened.error_bits) == (UPLINK, 5, 2, 3)
    assert opened.capacity_words == 4 and opened.stream_bytes == 10
    np.testing.assert_array_equal(np.asarray(opened.message.payload), msg.payload)
    assert int(opened.message.num_bits) == 77
    for kind in (WITHHELD, NOTICE):
        empty = seal(kind, None, round_index=1, client_id=0, fingerprint=FP)
        assert len(empty) == ENVELOPE_BYTES and open_envelope(empty, fingerprint=FP).message is None
    flipped = bytearray(env)
    flipped[ENVELOPE_BYTES + 9] ^= 0x10
    with pytest.raises(EnvelopeError, match="corrupted in transit") as err:
        open_envelope(bytes(flipped), fingerprint=FP)
    assert err.value.corrupt
    refusals = {
        "another configuration or seed": dict(fingerprint=config_fingerprint({"seed": 1})),
        "for round 5, expected round 6": dict(fingerprint=FP, round_index=6),
        "expected downlink": dict(fingerprint=FP, kinds=(DOWNLINK,)),
    }
    for text, kwargs in refusals.items():
        with pytest.raises(EnvelopeError, match=text) as err:
            open_envelope(env, **kwargs)
        assert not err.value.corrupt
    with pytest.raises(EnvelopeError, match="envelope version 9"):
        open_envelope(env[:3] + bytes([9]) + env[4:], fingerprint=FP)
    with pytest.raises(EnvelopeError, match="not a sidejax envelope"):
        open_envelope(b"GET / HTTP/1.1", fingerprint=FP)
    with pytest.raises(EnvelopeError, match="corrupted"):  # truncated: the CRC covers the length too
        open_envelope(env[:-1], fingerprint=FP)
    with pytest.raises(ValueError, match="fingerprint must be 8 bytes"):
        seal(UPLINK, msg, round_index=0, client_id=0, fingerprint=b"short")


def test_fingerprint_is_the_configuration():
    assert config_fingerprint({"a": 1, "b": [1, 2]}) == config_fingerprint({"b": [1, 2], "a": 1})
    assert config_fingerprint({"seed": 0}) != config_fingerprint({"seed": 1})


@pytest.fixture(scope="module")
def fedavg_setup():
    from helpers import every_algorithm

    spec, params, loss = model()
    algo = every_algorithm(loss, spec, num_clients=4, clients_per_round=3)["fedavg"]
    return algo, params, federation()


def _flip_stream_byte(client):
    def tamper(c, envelope):
        if c != client:
            return envelope
        b = bytearray(envelope)
        b[OVERHEAD_BYTES + 3] ^= 0x01
        return bytes(b)

    return tamper


def test_a_corrupted_uplink_is_flagged_and_excluded(fedavg_setup):
    """A byte flipped in transit: the server flags the stream (ERR_CRC in uplink_errors), excludes the
    participant, and aggregates the others: the same server state as the round without that reply."""
    from helpers import tree_equal

    algo, params, fed = fedavg_setup
    server, clients = parties(algo, params, fed, 4)
    report = loopback_round(server, clients, tamper=_flip_stream_byte(1))
    ids = [int(c) for c in np.asarray(report.info.client_ids)]
    assert 1 in ids and report.corrupt == (1,) and report.missing == ()
    j = ids.index(1)
    assert int(report.info.uplink_errors[j]) & ERR_CRC
    assert not bool(report.info.included[j]) and int(np.sum(report.info.included)) == len(ids) - 1
    dropped, others = parties(algo, params, fed, 4)
    missing = loopback_round(dropped, others, tamper=lambda c, e: None if c == 1 else e)
    assert missing.missing == (1,) and not bool(missing.info.included[j])
    assert tree_equal(server.server, dropped.server)


def test_too_few_replies_stop_the_round_and_keep_the_state(fedavg_setup):
    """min_replies: a round with fewer usable replies raises RoundFailedError naming who was missing; the
    server state and round are unchanged, and the round can be run again."""
    from helpers import tree_equal

    algo, params, fed = fedavg_setup
    server, clients = parties(algo, params, fed, 4)
    server.min_replies = 2
    before = server.server
    with pytest.raises(RoundFailedError, match=r"1 usable replies of 3 participants .*min_replies=2"):
        loopback_round(server, clients, tamper=lambda c, e: e if c == 0 else None)
    assert server.round_index == 0 and tree_equal(server.server, before)
    fresh_server, fresh_clients = parties(algo, params, fed, 4)
    loopback_round(fresh_server, fresh_clients)
    server2, clients2 = parties(algo, params, fed, 4)
    server2.min_replies = 2
    with pytest.raises(RoundFailedError):
        loopback_round(server2, clients2, tamper=lambda c, e: e if c == 0 else None)
    _, again = parties(algo, params, fed, 4)  # the clients start over: the failed round never happened
    report = loopback_round(server2, again)
    assert report.round_index == 0 and tree_equal(server2.server, fresh_server.server)


def test_a_party_of_another_configuration_is_refused(fedavg_setup):
    """A client started for another seed refuses the first downlink, and a server refuses its uplink; a
    replayed downlink is refused too."""
    algo, params, fed = fedavg_setup
    server, clients = parties(algo, params, fed, 4)
    _, strangers = parties(algo, params, fed, 4, config={"seed": 1})
    opening = server.open_round()
    c = opening.participants[0]
    with pytest.raises(EnvelopeError, match="another configuration or seed"):
        strangers[c].handle(opening.downlinks[c])
    server_b, _ = parties(algo, params, fed, 4, config={"seed": 1})
    server_b.open_round()
    reply = clients[c].handle(opening.downlinks[c])
    with pytest.raises(EnvelopeError, match="another configuration or seed"):
        server_b.close_round({c: reply})
    with pytest.raises(EnvelopeError, match="replay"):
        clients[c].handle(opening.downlinks[c])


def test_client_state_survives_its_bytes(fedavg_setup):
    """What a client keeps between rounds goes through bytes (Flower's Context.state) and back; a damaged
    buffer is refused with a message naming it."""
    from helpers import tree_equal

    algo, params, fed = fedavg_setup
    server, clients = parties(algo, params, fed, 4)
    loopback_round(server, clients)
    _, restored = parties(algo, params, fed, 4)
    for c in clients:
        restored[c].load_state(clients[c].state_bytes())
        assert restored[c].round_index == 1
        assert tree_equal(restored[c].view, clients[c].view)
        assert tree_equal(restored[c].client_state, clients[c].client_state)
    a = loopback_round(server, restored)
    assert a.round_index == 1 and a.missing == () and a.corrupt == ()
    with pytest.raises(ValueError, match="the client's saved state"):
        restored[0].load_state(b"not a saved state")
    tree = {"x": jax.numpy.ones(3), "k": jax.random.key(0)}
    back = tree_from_bytes(tree, tree_to_bytes(tree))
    np.testing.assert_array_equal(jax.random.key_data(back["k"]), jax.random.key_data(tree["k"]))
    with pytest.raises(ValueError, match="leaf 1 is float32"):
        tree_from_bytes(
            {"x": jax.numpy.ones(3), "y": jax.numpy.ones(2, jax.numpy.int32)},
            tree_to_bytes({"x": jax.numpy.ones(3), "y": jax.numpy.ones(2)}),
        )


# --- the Flower apps ------------------------------------------------------------------------------------

needs_flwr = pytest.mark.skipif(
    importlib.util.find_spec("flwr") is None,
    reason='the Flower apps need the extra: pip install "sidejax[flower]"',
)


def _engine_run(run_config: dict):
    """The same run by the engine in this process: each round's uplink hashes (sent streams) and the final
    server state."""
    from experiments.flower import federation as build
    from sidejax.fl import build_round_step
    from sidejax.keys import round_key

    fed_obj, prepared, config = build(run_config)
    algo, fed = fed_obj.algorithm, prepared.fed
    state = algo.init(fed_obj.init_key, fed_obj.params, fed_obj.num_clients)
    step = build_round_step(algo)
    phase_fn, round_fn = jax.jit(step.client_phase), jax.jit(step)
    hashes = []
    for t in range(fed_obj.num_rounds):
        rkey = round_key(fed_obj.base_key, t)
        phase = phase_fn(rkey, state, fed)
        state, info = round_fn(rkey, state, fed)
        row = []
        for j in range(int(phase.client_ids.shape[0])):
            msg = jax.tree.map(lambda a, j=j: a[j], phase.messages)
            row.append(hashlib.sha256(message_to_bytes(msg)).hexdigest())
        hashes.append(row)
    return hashes, state.server


def _check_against_engine(out: Path, run_config: dict):
    from helpers import assert_trees_close_across_programs

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    hashes, server = _engine_run(run_config)
    assert len(rows) == len(hashes)
    for row, want in zip(rows, hashes, strict=True):
        assert row["uplink_sha256"] == want, f"round {row['round']}: a client's message differs"
        for bits, stream, env, flower_bytes in zip(
            row["uplink_bits"],
            row["uplink_stream_bytes"],
            row["uplink_envelope_bytes"],
            row["flower_uplink_bytes"],
            strict=True,
        ):
            assert stream == -(-bits // 8) and env == stream + OVERHEAD_BYTES and flower_bytes > env
        assert row["missing"] == [] and row["corrupt"] == [] and all(row["included"])
    got = tree_from_bytes(server, (out / "server_state.npz").read_bytes())
    assert_trees_close_across_programs(got, server, 8)
    return rows


def _run_config(out: Path, algorithm: str, *extra: str, min_replies: int = 1, round_timeout: float = 120.0):
    from argparse import Namespace

    from experiments.flower import run_config_for

    sets = ["data.num_clients=3", "run.rounds=3", *extra]
    args = Namespace(
        preset=None,
        algorithm=algorithm,
        set=sets,
        out=str(out),
        min_replies=min_replies,
        round_timeout=round_timeout,
    )
    return run_config_for(args)


_SMALL_BPCFL = (
    "run.rounds=1",
    "method.num_trajectories=2",
    "method.pretrain_steps=30",
    "method.num_updates=4",
    "method.data_chain_length=10",
    "method.coreset_chain_length=10",
    "method.pairs_per_update=2",
    "method.num_noise=2",
    "method.map_steps=10",
)


def _no_process_left(token: str) -> None:
    """Every process the launcher started (and what they started) has ended."""
    import time

    from experiments.flower import _marked_pids

    deadline = time.monotonic() + 20
    while _marked_pids(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked_pids(token) == []


def _deployment_matches_the_engine(tmp_path, algorithm: str, rounds: int) -> None:
    from experiments.flower import deploy

    token = f"test-{algorithm.replace('+', '-')}-{tmp_path.name}"
    rc = _run_config(tmp_path / "run", algorithm, f"run.rounds={rounds}")
    try:
        out = deploy(rc, 3, timeout=400, token=token)
    finally:
        _no_process_left(token)
    rows = _check_against_engine(out, rc)
    assert len(rows) == rounds and all(len(r["participants"]) == 3 for r in rows)
    assert (out / "bytes.md").read_text().count("\n| ") == 1 + 3 * rounds  # the header, then the uplinks
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == rounds and summary["final_test_accuracy"] is not None


# Flower starts a ClientApp process per message (each imports JAX, builds the run and reads the compiled
# kernels from the run's compilation cache) and polls every 3 s: 2-3 min a method for three rounds on the
# 2-core CPU, so the deployments are slow tests (`make test-all`, CI). FedPM-KLMS: round 0 is a KLMS update
# round, so the later downlinks carry new partitions that every client must follow from its own view; CEPAM:
# a lattice stream. What is particular to an algorithm apart (its client state, its view of the server) is
# checked for all of them over the loopback transport (tests/fl/test_roles.py) and for six in Flower's
# simulation runtime below; the deployment adds the processes and Flower's wire, which are the same for all.
@needs_flwr
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedpm_klms", "cepam+lrsuq"])
def test_deployment_sends_the_engines_bytes(tmp_path, algorithm):
    """A SuperLink, 3 SuperNodes and `flwr run` on 127.0.0.1, three rounds: each client's uplink of each
    round is the engine's message bit for bit (its hash), each stream is ceil(bits / 8) bytes in a 44-byte
    envelope inside Flower's larger message, the server state agrees with run_rounds' within 8 ULP, and
    every process has ended."""
    _deployment_matches_the_engine(tmp_path, algorithm, 3)


@needs_flwr
def test_deploy_refuses_a_folder_that_holds_files(tmp_path):
    from experiments.flower import main

    (tmp_path / "keep.txt").write_text("mine")
    assert main(["deploy", str(tmp_path), "--algorithm", "fedavg"]) == 1
    assert (tmp_path / "keep.txt").read_text() == "mine" and len(list(tmp_path.iterdir())) == 1
    assert main(["deploy", str(tmp_path / "new"), "--algorithm", "fedavg", "--set", "run.rounds"]) == 2
    assert main(["deploy", str(tmp_path / "new"), "--algorithm", "fedavg", "--supernodes", "4"]) == 2
    assert not (tmp_path / "new").exists()


@needs_flwr
@pytest.mark.slow  # a deployment with two faults: about 2 min
def test_deployment_faults_exclude_or_stop(tmp_path):
    """Round 2: client 1's uplink is corrupted in transit (the flip hook): flagged (ERR_CRC) and excluded;
    after round 2 client 2's SuperNode is killed: round 3 goes on without it once its 60 s round_timeout has
    passed (min_replies=1; a live client answers in 12-20 s, 40 s in round 1, which compiles). The same
    deployment with min_replies=3 stops at round 3 with a clear error. Every process ends either way."""
    from experiments.flower import deploy
    from sidejax.flower.apps import FLIP_ENV

    token = f"test-faults-{tmp_path.name}"
    rc = _run_config(tmp_path / "run", "fedavg", round_timeout=60.0)
    try:
        out = deploy(rc, 3, timeout=600, kill_after_round=(2, 2), node_env={FLIP_ENV: "1:1"}, token=token)
    finally:
        _no_process_left(token)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["corrupt"] == [1] and rows[1]["included"] == [True, False, True]
    assert rows[1]["uplink_errors"][1] & ERR_CRC
    assert rows[2]["missing"] == [2] and rows[2]["included"] == [True, True, False]
    token = f"test-stop-{tmp_path.name}"
    rc = _run_config(tmp_path / "stop", "fedavg", min_replies=3, round_timeout=60.0)
    with pytest.raises(RuntimeError, match="min_replies=3"):
        try:
            deploy(rc, 3, timeout=600, kill_after_round=(2, 2), token=token)
        finally:
            _no_process_left(token)
    assert len((tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()) == 2


@needs_flwr
@pytest.mark.slow  # Flower's simulation runtime (Ray) for the six methods: about 1-2 min each
@pytest.mark.parametrize(
    "algorithm",
    ["fedavg", "fedpm_klms", "qsgd_klms", "bicompfl_gr+klms", "cepam+lrsuq", "bpcfl+pseudocoreset"],
)
def test_simulation_runtime_sends_the_engines_bytes(tmp_path, algorithm):
    """Flower's simulation runtime (Ray actors as SuperNodes) gives the engine's messages and server state
    too. BPC-FL's one round at a small size (its CPU settings take minutes a client)."""
    from experiments.flower import simulate

    extra = _SMALL_BPCFL if algorithm.startswith("bpcfl") else ()
    rc = _run_config(tmp_path / "run", algorithm, *extra)
    out = simulate(rc, 3)
    _check_against_engine(out, rc)


@needs_flwr
@pytest.mark.slow  # a deployment started and stopped: about 30 s
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_launcher_stops_every_process_it_started(tmp_path, sig):
    """Ctrl-C (SIGINT) or `kill` (SIGTERM) of `python -m experiments.flower deploy` once the SuperNodes run:
    it exits with 130 and no process it started (or that Flower spawned for it) is left."""
    import os
    import signal
    import subprocess
    import time

    from experiments.flower import MARKER, REPO

    token = f"test-{sig}-{tmp_path.name}"
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-c",
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = sys.argv[1:]; from experiments.flower import main; sys.exit(main(sys.argv[1:]))",
        "x",
        "deploy",
        str(out),
        "--algorithm",
        "fedavg",
        "--set",
        "data.num_clients=3",
        "run.rounds=20",
    ]
    env = {**os.environ, MARKER: token, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "logs" / "supernode_2.log").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)
        assert proc.poll() is None, "the launcher ended before it was interrupted"
        os.kill(proc.pid, getattr(signal, sig))
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _no_process_left(token)
