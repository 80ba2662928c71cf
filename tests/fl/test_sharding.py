"""The client map over a device mesh (``ClientMap.mesh``, ``mesh_client_map``).

Several CPU devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts, so the
multi-device checks run ``tests/fl/sharded_family.py`` in a subprocess (slow: every algorithm compiles four
programs there). This process has one device: the bad-input checks run here."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import forced_devices_env
from jax.sharding import Mesh

from sidejax.fl import CLIENT_AXIS, ClientMap, as_client_map, build_round_step, mesh_client_map
from sidejax.keys import round_key

SCRIPT = Path(__file__).with_name("sharded_family.py")
ROOT = Path(__file__).resolve().parents[2]


def test_mesh_client_map_splits_over_the_clients_axis():
    cmap = mesh_client_map(1)
    assert cmap.mesh.axis_names == (CLIENT_AXIS,) and cmap.num_shards == 1
    assert cmap.strategy in ("map", "vmap") and as_client_map(cmap) == cmap
    assert ClientMap("map").num_shards == 1


def test_more_devices_than_there_are_is_refused_with_the_fix():
    with pytest.raises(
        ValueError, match="devices=2 but this run has 1 device.*xla_force_host_platform_device"
    ):
        mesh_client_map(2)
    with pytest.raises(ValueError, match="devices is empty"):
        mesh_client_map([])


def test_a_mesh_without_the_client_axis_is_refused(fedavg_map):
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="no axis named 'clients'.*mesh_client_map"):
        build_round_step(fedavg_map, client_map=ClientMap("map", mesh=mesh))
    with pytest.raises(TypeError, match="must be None or a jax.sharding.Mesh"):
        as_client_map(ClientMap("map", mesh="clients:8"))


def test_a_one_device_mesh_gives_the_single_device_round(fedavg_map, small_model, digits_fed):
    """The sharded path (padding, shard_map, slicing) on one device: the same messages bit for bit."""
    from helpers import BASE, tree_equal

    state = fedavg_map.init(BASE, small_model[1], 10)
    rkey = round_key(BASE, 0)
    one = jax.jit(build_round_step(fedavg_map, client_map="map").client_phase)(rkey, state, digits_fed)
    mesh = jax.jit(build_round_step(fedavg_map, client_map=mesh_client_map(1, strategy="map")).client_phase)(
        rkey, state, digits_fed
    )
    assert tree_equal(one.messages, mesh.messages) and tree_equal(one.client_ids, mesh.client_ids)


def test_placing_on_a_one_device_mesh_changes_no_bit(fedavg_map, small_model, digits_fed):
    """place_federation + run_rounds on a one-device mesh: the same state and records as unplaced; the
    placed examples and state read back whole (gather_to_host), typed keys included."""
    from helpers import BASE, tree_equal

    from sidejax.fl import client_state_split, gather_to_host, place_federation, run_rounds

    cmap = mesh_client_map(1, strategy="map")
    state = fedavg_map.init(BASE, small_model[1], 10)
    placed_state, placed_fed = place_federation(cmap, state, digits_fed)
    assert client_state_split(cmap, 10) and not client_state_split(ClientMap("map"), 10)
    assert tree_equal(gather_to_host(placed_state), state) and tree_equal(
        gather_to_host(placed_fed), digits_fed
    )
    assert place_federation("map", state, digits_fed) == (state, digits_fed)
    keys = gather_to_host({"k": jax.random.split(BASE, 3)})["k"]
    assert tree_equal(keys, jax.random.split(BASE, 3))
    one = run_rounds(fedavg_map, BASE, state, digits_fed, 2, client_map="map")
    many = run_rounds(fedavg_map, BASE, placed_state, placed_fed, 2, client_map=cmap)
    assert tree_equal(one[1].uplink_bits, many[1].uplink_bits)
    assert tree_equal(one[1].client_ids, many[1].client_ids)
    from helpers import assert_trees_close_across_programs

    assert_trees_close_across_programs(gather_to_host(many[0]), one[0], 8)


def _run_family(names: list[str], devices: int, *flags: str, timeout: int = 1500):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", str(devices), *flags, *names],
        env=forced_devices_env(devices),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, rows


@pytest.mark.breadth  # every algorithm compiles four programs on 8 forced devices: several minutes
def test_every_algorithm_sharded_over_8_devices_equals_one_device():
    """16 clients (the client state split 2 per device), 10 participants per round (padded to 16). The
    algorithms in two interleaved halves, one subprocess each, at once: run as one subprocess, the sweep was
    the last test of its run, for minutes, with the other core idle."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(lambda part: _run_family([], 8, "--part", f"{part}/2"), range(2)))
    for proc, rows in halves:
        failed = [r for r in rows if not r["ok"]]
        assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert sum(len(rows) for _, rows in halves) >= 20, [proc.stdout for proc, _ in halves]


@pytest.mark.slow  # a subprocess with 8 forced devices, four programs per algorithm
def test_a_client_count_the_devices_do_not_divide_keeps_the_client_state_replicated():
    """12 clients on 8 devices: the client state cannot be split evenly and stays replicated; the rounds are
    still the single-device ones (FedAvg, pFedBayes' personal posteriors, BICompFL-PR's estimates)."""
    names = ["fedavg", "pfedbayes", "bicompfl_pr_splitdl"]
    proc, rows = _run_family(names, 8, "--num-clients", "12", timeout=900)
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not failed and len(rows) == 3, (failed, proc.stdout, proc.stderr[-3000:])


@pytest.mark.slow  # a subprocess with 8 forced devices
def test_more_devices_than_participants_is_refused_naming_both():
    code = textwrap.dedent(
        """
        import jax, optax
        from sidejax.algorithms import fedavg
        from sidejax.data import load_dataset, make_federated_data, partition
        from sidejax.fl import LocalTraining, classification_loss, mesh_client_map, run_rounds
        from sidejax.models import get_model, init_params
        train = load_dataset("digits", "train")
        fed = make_federated_data(train.x, train.y, partition("iid", train.y, 6, seed=0))
        spec = get_model("mlp_32_16", num_classes=10, input_shape=(8, 8, 1))
        loss = classification_loss(spec.module.apply)
        algo = fedavg(loss, LocalTraining(optax.sgd(0.1), batch_size=16), clients_per_round=3)
        state = algo.init(jax.random.key(0), init_params(jax.random.key(0), spec), 6)
        try:
            run_rounds(algo, jax.random.key(1), state, fed, 1, client_map=mesh_client_map(8))
        except ValueError as e:
            print("REFUSED:", e)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=forced_devices_env(8),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (
        "REFUSED: client_map splits the participants over 8 devices but a round has only 3" in proc.stdout
    ), proc.stdout + proc.stderr[-2000:]
