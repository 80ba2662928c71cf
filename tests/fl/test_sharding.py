"""The client map over a device mesh (``ClientMap.mesh``, ``mesh_client_map``).

Several CPU devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts, so the
multi-device checks run ``tests/fl/sharded_family.py`` in a subprocess (slow: every algorithm compiles four
programs there). This process has one device: the bad-input checks run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from sidejax.fl import CLIENT_AXIS, ClientMap, as_client_map, build_round_step, mesh_client_map
from sidejax.keys import round_key

SCRIPT = Path(__file__).with_name("sharded_family.py")
ROOT = Path(__file__).resolve().parents[2]


def _forced_devices_env(n: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    return env


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


def _run_family(names: list[str], devices: int, strategy: str = "map", timeout: int = 1500):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", str(devices), "--strategy", strategy, *names],
        env=_forced_devices_env(devices),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, rows


@pytest.mark.slow  # every algorithm compiles four programs on 8 forced devices: several minutes
def test_every_algorithm_sharded_over_8_devices_equals_one_device():
    proc, rows = _run_family([], 8)
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert len(rows) >= 20, proc.stdout


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
        env=_forced_devices_env(8),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (
        "REFUSED: client_map splits the participants over 8 devices but a round has only 3" in proc.stdout
    ), proc.stdout + proc.stderr[-2000:]
