"""Shared fixtures: small federations and models, built once per session so tests share compilations.

Helpers shared by test modules live in ``tests/helpers.py`` (``from helpers import tree_equal``);
``tree_equal`` is re-exported here for test modules that still import it from ``conftest``."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

# JAX's persistent compilation cache: the suite compiles the same programs on every run (and CI runs on the
# machine that ran them last), so compiled executables are kept on disk and reused. Set through environment
# variables so that notebook kernels and CLI subprocesses started by the tests share it. A cached executable
# is the same compiled program, so bit-equality tests within one program are unaffected. Override with
# JAX_COMPILATION_CACHE_DIR (an empty value disables it).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sidejax", "jax-tests"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import jax
import numpy as np
import optax
import pytest
from helpers import BASE, small_algorithm, tree_equal  # noqa: F401  (tree_equal re-exported)

from sidejax.algorithms import fedavg
from sidejax.data import datasets as datasets_module
from sidejax.data import load_dataset, make_federated_data, partition
from sidejax.data import tfds as tfds_module
from sidejax.fl import LocalTraining, classification_loss, run_rounds
from sidejax.models import get_model, init_params

# Linux's default vm.max_map_count is 65,530; clear well below it.
MAX_CODE_MAPPINGS = 20_000


def _memory_mappings() -> int | None:
    """The number of memory mappings of this process (``None`` where ``/proc/self/maps`` does not exist)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's in-memory compiled executables after a test module once the process holds many.

    Every CPU executable keeps its code mapped in the process, and the suite compiles thousands of them:
    measured, the process held 46,577 memory mappings after tests/algorithms and tests/coding alone, and the
    whole suite crossed Linux's default ``vm.max_map_count`` (65,530), where LLVM's next code mapping fails
    and the process dies (a segfault or abort inside the compilation cache, in whichever test came last).
    Clearing after every module kept it under 8,000 but also dropped the programs later modules share (the
    session fixtures' rounds, eager kernels too quick to compile for the persistent cache), which were then
    traced and compiled, or read back, again. Now the caches are cleared only once the process holds more
    than ``MAX_CODE_MAPPINGS`` mappings (after every module where the count cannot be read)."""
    yield
    count = _memory_mappings()
    if count is None or count > MAX_CODE_MAPPINGS:
        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the marks
def pytest_collection_modifyitems(items):
    """A breadth sweep is a slow test: ``make test`` (``-m "not slow"``) leaves it out without each sweep
    carrying both marks."""
    for item in items:
        if item.get_closest_marker("breadth") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def digits():
    return load_dataset("digits", "train"), load_dataset("digits", "test")


@pytest.fixture(scope="session")
def digits_fed(digits):
    """10 unequal clients (label shards, c_max=3) over a 600-example subset of digits."""
    train, _ = digits
    keep = np.random.default_rng(0).permutation(len(train.y))[:600]
    x, y = train.x[keep], train.y[keep]
    parts = partition("shards", y, 10, seed=0, c_max=3)
    return make_federated_data(x, y, parts)


@pytest.fixture(scope="session")
def small_model():
    spec = get_model("mlp_32_16", num_classes=10, input_shape=(8, 8, 1))
    params = init_params(jax.random.key(0), spec)
    return spec, params, classification_loss(spec.module.apply)


@pytest.fixture(scope="session")
def fedavg_map(small_model):
    """FedAvg on ``small_model``: 4 of 10 clients per round, one local epoch of batches of 16."""
    _, _, loss = small_model
    return fedavg(loss, LocalTraining(optax.sgd(0.1), batch_size=16, num_epochs=1), clients_per_round=4)


@pytest.fixture(scope="session")
def fedavg_ten_rounds(fedavg_map, small_model, digits_fed):
    """``(state0, (final, infos))``: 10 rounds of ``fedavg_map`` on ``digits_fed`` from ``helpers.BASE``
    with ``client_map="map"`` (one compiled program, shared by the engine's and FedAvg's tests)."""
    _, params, _ = small_model
    state = fedavg_map.init(BASE, params, 10)
    return state, run_rounds(fedavg_map, BASE, state, digits_fed, 10, client_map="map")


@pytest.fixture(scope="session")
def algorithm_run(small_model, digits_fed):
    """``algorithm_run(name) -> (algo, state0, final, infos)``: 3 rounds of ``helpers.small_algorithm(name)``
    (5 of 10 clients per round, ``client_map="map"``, init key 0, base key 1) on ``digits_fed``, run once per
    session and shared by the algorithms' test modules."""
    _, params, loss = small_model
    runs = {}

    def run(name: str):
        if name not in runs:
            algo = small_algorithm(name, loss, 5)
            state = algo.init(jax.random.key(0), params, 10)
            final, infos = run_rounds(algo, jax.random.key(1), state, digits_fed, 3, client_map="map")
            runs[name] = (algo, state, final, infos)
        return runs[name]

    return run


@pytest.fixture
def no_local_data(tmp_path, monkeypatch):
    """Makes sure no real dataset can be found: empty env dir, fake HOME and Debian root, no TFDS."""
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("SIDEJAX_DATA_DIR", str(env_dir))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(datasets_module, "DEBIAN_DATA_ROOT", str(tmp_path / "debian"))
    monkeypatch.setattr(tfds_module, "tfds_installed", lambda: False)
    return tmp_path
