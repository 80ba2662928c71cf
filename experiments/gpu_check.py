"""``make gpu-check``: one bounded run that says whether sidejax works on the accelerator at hand, and how
fast and how large each paper's setting is there. No dataset files are needed.

Run from the repository root (after ``pip install -e ".[cuda]"`` on an NVIDIA machine)::

    python -m experiments.gpu_check [--output results/gpu_check] [--quick] [--budget-s 560] ...  # --help

Sections, in order (each heavy one in its own subprocess, with a timeout; this process never starts a JAX
backend, so it holds no device memory):

1. ``device``: ``jax.default_backend()``, the devices (``device_kind``, ``memory_stats()["bytes_limit"]``),
   the jax and jaxlib versions and ``jax.print_environment_info`` (``nvidia-smi`` on a GPU). Without an
   accelerator the run goes on and says that every figure is a CPU figure (``accelerator: false``).
2. ``tests``: ``pytest -m "not slow or accelerator" -p no:cacheprovider -v`` on :data:`ACCELERATOR_TESTS`,
   the tests whose numerics or compiled programs could differ on an accelerator. Counts come from pytest's
   JUnit XML; pytest's exit code 5 (nothing collected) is a failure. With an accelerator and pytest-xdist,
   up to 4 workers (``--test-workers``) share the device.
3. ``presets``: one paper-scale preset per paper (:data:`PAPER_PRESETS`) on **synthetic data of the real
   shapes**: the dataset loader the driver uses (``experiments.driver.load_dataset``) is replaced, in the
   preset's subprocess only, by :func:`synthetic_dataset`, which returns random images in ``[0, 1]`` with
   the real dataset's number of training and test examples, image shape and number of classes (balanced
   labels). Everything else is the driver's own :func:`experiments.driver.prepare` (the preset's partition,
   train subset and client sizes, the model, the algorithm), then :func:`sidejax.fl.run_rounds` with the
   run's client map: round 1 (compilation and the first round), then round 2 from its state (the steady
   round: the same compiled program, timed with ``jax.block_until_ready``), then one evaluation of the
   global model. A one-shot method (BPC-FL) runs its one round twice from the initial state instead. A
   preset fails on an exception, a timeout, a non-finite loss or parameter, or an invalid stream. BPC-FL's
   step counts and clients are cut to fit the budget, every per-step shape kept (``overrides`` and ``why``
   in the report).
4. ``benchmarks``: the benchmark scripts of ``experiments/bench`` that measure accelerator work
   (:data:`BENCHMARKS`), each with its JSON written under ``<output>/bench/`` and copied into the report.
   The PyTorch-on-CPU comparisons (``bicompfl_round``, ``torch_compare``) are listed as not run, and
   ``sharding`` needs two devices or more.

``--budget-s`` (default 560) bounds the whole run: every subprocess's timeout is what the budget has left
(keeping a minimum for each preset still to run), and an item that would not fit is recorded as skipped
with the reason, never dropped. The caps follow the first GPU report (an H200, 2026-11-26, jax 0.11.2): the
tests had run 94% of their cases when the first cap of 150 s cut them off (4 workers or 8), the five
presets took 171 s and the benchmarks 138 s before the budget of 480 s ran out on the last; hence a
210 s cap for the tests and 560 s in all, which fits one device call of 600 s. ``--quick`` runs reduced
settings (:data:`QUICK_PRESETS`: the papers' CPU presets shrunk further, two small test files, the
benchmarks' small sizes, the compile-heavy ``klms_round`` and ``bpcfl_update`` left out) to test this script
on a CPU: two to three minutes on a 2-core CPU with a cold compilation cache; its figures say nothing about
paper scale.

The report, ``<output>/gpu_check.json`` (rewritten after every section; an existing report is kept unless
``--overwrite``):

- ``accelerator`` (bool), ``note`` (set when there is none), ``device`` (section 1), ``environment``
  (python, cpu count, the XLA / JAX environment variables, the git commit and ``git_dirty``);
- ``tests``: ``status`` (``passed``, ``failed``, ``timeout``, ``error``, ``skipped``), ``counts``
  (``passed``, ``failed``, ``errors``, ``skipped``), ``failed_tests`` (from the JUnit XML, or, when pytest
  was cut off by its timeout, from the lines it printed so far), ``duration_s``, ``command`` and ``log``
  (``<output>/tests.log``: pytest's whole output, the tracebacks of the failures included);
- ``presets``: one entry per paper: ``preset``, ``overrides`` (what was changed from the preset file, and
  ``why``), ``status``, ``data`` (dataset, ``synthetic``, train/test shapes, classes, clients, examples per
  client), ``num_params``, ``client_strategy``, ``prepare_s`` (data and algorithm), ``init_s`` (the
  parameters and ``algorithm.init``, jitted: ``init_mode``),
  ``compile_and_first_round_s`` (the first ``run_rounds`` call: tracing, compilation and round 1),
  ``steady_round_s`` (the second call),
  ``eval_s`` (the first evaluation, with its compilation), ``uplink_bits`` / ``downlink_bits`` (per round,
  summed over the participants), ``uplink_bpp`` / ``downlink_bpp`` (per parameter per participant),
  ``finite``, ``streams_valid`` and ``stream_problems`` (the first bad round's clients and reasons, as the
  driver names them), ``peak_bytes_in_use`` (the whole subprocess) and
  ``peak_bytes_in_use_rounds`` (before the evaluation) and ``bytes_limit`` of device 0
  (``device.memory_stats()``; ``null`` with ``memory_note`` where the backend reports none, e.g. the CPU),
  ``peak_rss_mb`` (the subprocess's host memory), ``wall_s``;
- ``benchmarks``: per script ``status``, ``command``, ``duration_s``, ``json`` (its path) and ``result``
  (its JSON);
- ``skipped`` (section, item, reason), ``failures`` (section, item, reason), ``ok``, ``wall_s``.

Exit status: 0 when the device facts were read and no test and no preset failed (benchmark failures are
reported in ``failures``, ``ok`` and the summary, not in the exit status), 1 otherwise, 2 for bad
arguments or a report already there.

Device memory: the subprocesses run with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless set), so that
the pytest workers and the tests' own subprocesses do not each reserve 75% of the device;
``peak_bytes_in_use`` counts the buffers a preset's process held at most, whatever the allocator reserved.
JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) is left as the environment sets it,
and recorded, since a warm cache shortens the compile figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from experiments.bench.common import parser

ROOT = Path(__file__).resolve().parents[1]
REPORT = "gpu_check.json"
DEFAULT_OUTPUT = Path("results/gpu_check")
DEFAULT_BUDGET_S = 560.0
#: seconds of the budget kept for writing the report and the summary
REPORT_RESERVE_S = 5.0
#: what a preset subprocess prints before its result's JSON (one line)
RESULT_TAG = "GPU_CHECK_RESULT "

#: which tests of those files run: the fast ones, and the slow ones marked ``accelerator`` (sizes that take a
#: CPU long but an accelerator seconds: the KLMS coder at CONV6's dimension)
TEST_MARKERS = "not slow or accelerator"
#: tests whose numerics or compiled programs could differ on an accelerator (run with -m TEST_MARKERS)
ACCELERATOR_TESTS = (
    "tests/coding/test_counter.py",  # the candidate generator: the numpy oracle's words, bit for bit
    "tests/coding/test_wire.py",  # messages as bytes: the header, the format check
    "tests/coding/test_importance.py",  # counter-based candidates, Gumbel-max choice, decode = encode
    "tests/coding/test_importance_law.py",  # the real coder against the exact importance-sampling law
    "tests/coding/test_klms.py",  # KL blocks by pointer doubling, bucketed work, the KLMS stream
    "tests/coding/test_klms_avg.py",  # BICompFL's Adaptive-Avg coder, its streamed encoder
    "tests/coding/test_coders.py",  # every coder's contract: decode(encode(q)) on the device, bit counts
    "tests/coding/test_lattice.py",  # CEPAM: LRSUQ / SDQ coders with real streams
    "tests/coding/test_lrsuq.py",  # layered rejection sampling: the error is exactly the noise law
    "tests/test_lattices.py",  # nearest-point search of Z^n, A2, D4, E8
    "tests/coding/test_bitstream.py",  # bit packing, Elias-gamma, Golomb (uint32 arithmetic)
    "tests/test_keys.py",  # the key schedule: streams independent, bit-identical messages
    "tests/fl/test_rounds.py",  # the round engine: chunks equal one run, no recompilation, vmap = map
    "tests/fl/test_local.py",  # local training: padding batches, epochs = steps bit for bit
    "tests/fl/test_sharding.py",  # the mesh client map on the devices present
    "tests/models/test_conv.py",  # the models' convolution and its gradients against lax
    "tests/bayes/test_coresets.py",  # A-IHT (CoreSet-PFedBayes' coreset solver)
)
#: --quick: two small files (about 15 s on a 2-core CPU), enough to exercise the section
QUICK_TESTS = ("tests/coding/test_bitstream.py", "tests/test_lattices.py")


def _dotted(text: str) -> dict[str, int]:
    """``"data.num_clients=3 method.local_steps=3"`` -> ``{"data.num_clients": 3, "method.local_steps": 3}``:
    the integer overrides of the tables below, written compactly."""
    return {key: int(value) for key, value in (item.split("=") for item in text.split())}


#: BPC-FL's paper round is hours of client work (500 BPC-fKL updates of 5 chains of 250 steps, for each of
#: 100 clients); these keep every per-step shape (the ConvNet, K = 62, the 50 expert trajectories and their
#: checkpoints, which set a client's memory, the chain lengths) and cut the counts of steps and clients
#: (clients run one at a time: client_strategy map)
@dataclass(frozen=True)
class PresetCheck:
    """One paper's preset in the ``presets`` section.

    Attributes:
      paper: the paper's name (the report's key).
      preset: the preset in ``experiments/presets``.
      overrides: dotted-key overrides applied to the preset (empty: the preset as it is).
      why: the reason for ``overrides``.
      cap_s: the longest its subprocess may run (the budget may allow less).
    """

    paper: str
    preset: str
    overrides: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    cap_s: float = 90.0


#: BPC-FL's paper round is hours of client work (500 BPC-fKL updates of 5 chains of 250 steps, for each of
#: 100 clients); these keep every per-step shape (the ConvNet, K = 62, the 50 expert trajectories and their
#: checkpoints, which set a client's memory, the chain lengths) and cut the counts of steps and clients
#: (clients run one at a time: client_strategy map)
_BPCFL_GPU = PresetCheck(
    "BPC-FL",
    "bpcfl_emnist_bpcfl_hmc",
    _dotted("data.num_clients=5 method.num_updates=2 method.map_steps=50 method.hmc_burnin=10"),
    "the paper's round (500 BPC-fKL updates for each of 100 clients) does not fit the budget: the update "
    "and MAP/HMC step counts and the clients (run one at a time) are cut; every per-step shape (ConvNet, "
    "K = 62, 50 expert trajectories and their checkpoints, chain lengths) is the paper's",
    cap_s=150.0,
)

#: one paper-scale preset per paper: the paper's largest setting that its presets mark for a GPU. KLMS: CONV6,
#: 2.26 M parameters, its main CIFAR-10 table (``--presets klms_cifar100_resnet18_fedpm_klms_iid`` runs the
#: larger ResNet-18); BICompFL: CONV6 with 256 candidates a block, its largest coder work; CEPAM: 30 clients,
#: layered quantization on Z^3; CoreSet-PFedBayes: A-IHT every round, the largest coreset; BPC-FL: the
#: EMNIST-62 ConvNet, HMC through blackjax
PAPER_PRESETS = (
    PresetCheck("KLMS", "klms_cifar10_conv6_fedpm_klms_iid"),
    PresetCheck("BICompFL", "bicompfl_cifar10_conv6_iid_gr_adaptive"),
    PresetCheck("CEPAM", "cepam_mnist_cnn_cepam_gauss_z3"),
    PresetCheck("CoreSet-PFedBayes", "coreset_pfedbayes_mnist_mlp_coreset_50"),
    _BPCFL_GPU,
)

_QUICK_WHY = "--quick: a few seconds of CPU per preset (shapes reduced; not a paper-scale figure)"
#: --quick: each paper's reduced CPU preset, shrunk to seconds on a 2-core CPU: (paper, preset, overrides)
QUICK_PRESETS = tuple(
    PresetCheck(paper, preset, _dotted(overrides), _QUICK_WHY, cap_s=60.0)
    for paper, preset, overrides in (
        (
            "KLMS",
            "klms_fmnist_fedpm_klms",
            "data.num_clients=3 data.train_subset=384 coder.log2_num_candidates=4",
        ),
        ("BICompFL", "bicompfl_fmnist_lenet5_cpu_gr_adaptive", "data.num_clients=3 data.train_subset=384"),
        (
            "CEPAM",
            "cepam_fmnist_cnn_cpu_cepam_gauss_z3",
            "data.num_clients=4 data.examples_per_client=64 method.local_steps=3",
        ),
        (
            "CoreSet-PFedBayes",
            "coreset_pfedbayes_fmnist_mlp_cpu_coreset_50",
            "data.num_clients=3 data.examples_per_label=40 method.local_iters=2 method.personal_steps=2 "
            "method.batch_size=20 method.coreset_size=10 method.coreset_every=1 method.aiht_max_iter=10",
        ),
        (
            "BPC-FL",
            "bpcfl_fmnist_cpu_bpcfl_adam",
            "data.num_clients=3 data.train_subset=300 method.num_updates=2 method.num_trajectories=2 "
            "method.pretrain_steps=20 method.data_chain_length=5 method.coreset_chain_length=5 "
            "method.pairs_per_update=2 method.num_noise=2 method.map_steps=5",
        ),
    )
)

#: the paper of each preset-name prefix (for --presets)
_PAPER_OF_PREFIX = {
    "klms_": "KLMS",
    "bicompfl_": "BICompFL",
    "cepam_": "CEPAM",
    "coreset_pfedbayes_": "CoreSet-PFedBayes",
    "bpcfl_": "BPC-FL",
}


@dataclass(frozen=True)
class Bench:
    """A benchmark script run by the ``benchmarks`` section.

    Attributes:
      name: the script's name in ``experiments/bench``.
      full, quick: its arguments, split at spaces (the JSON path flag is added); ``quick`` ``None``: not run
        with --quick (its compilation alone takes most of a minute on a 2-core CPU).
      out_flag: its flag for the JSON path.
      why: what it measures on an accelerator.
      synthetic: run it with :func:`synthetic_datasets` installed (it reads a dataset through the driver).
      cap_s: the longest it may run.
    """

    name: str
    full: str
    quick: str | None
    out_flag: str
    why: str
    synthetic: bool = False
    cap_s: float = 60.0


#: the benchmarks that measure accelerator work, most important first (sizes cut to fit the budget)
BENCHMARKS = (
    Bench(
        "importance_coder",
        "--dims 61706,2262602 --log2k 8 --repeats 3",
        "--dims 61706 --log2k 4 --repeats 1",
        "--output",
        "the importance-sampling coder (KLMS, BICompFL) against the candidate-generation floor, LeNet5 and "
        "CONV6 sizes",
    ),
    Bench(
        "local_training",
        "--clients 10 --repeats 2 --convs sidejax",
        "--clients 2 --examples-per-client 64 --repeats 1 --convs sidejax --strategies map",
        "--output",
        "LeNet5 local training, vmap against map clients",
    ),
    Bench(
        "klms_round",
        "--warmup-rounds 2 --repeats 2",
        None,
        "--out",
        "the KLMS coder's share of a FedPM-KLMS round (on synthetic Fashion-MNIST shapes)",
        synthetic=True,
    ),
    Bench(
        "cepam_quantize",
        "--lattices z1 z3 e8 --repeats 3",
        "--dim 1024 --lattices z2 --repeats 1",
        "--out",
        "CEPAM's LRSUQ per lattice against plain noise addition",
    ),
    Bench(
        "bpcfl_update",
        "--updates 5 --repeats 1 --skip-through",
        None,
        "--out",
        "one BPC-fKL update (BPC-FL's client hot path) against a per-chain loop",
    ),
    Bench(
        "aiht",
        "--ks 500 --repeats 2",
        "--quick",
        "--out",
        "CoreSet-PFedBayes' A-IHT solver, vmapped over clients, against numpy",
    ),
)
#: benchmark scripts not run, and why (listed in the report's ``skipped``)
NOT_RUN_BENCHMARKS = {
    "bicompfl_round": "compares with PyTorch on the CPU, single-threaded: not an accelerator measurement",
    "torch_compare": "compares LeNet5 training with PyTorch on the CPU, single-threaded: not an accelerator "
    "measurement",
}

#: (train examples, test examples, example shape, classes) of the datasets that need files, as their files
#: hold them; EMNIST's sizes are per subset (:data:`EMNIST_SIZES`)
REAL_SHAPES: dict[str, tuple[int, int, tuple[int, ...], int]] = {
    "mnist": (60_000, 10_000, (28, 28, 1), 10),
    "fashion_mnist": (60_000, 10_000, (28, 28, 1), 10),
    "cifar10": (50_000, 10_000, (32, 32, 3), 10),
    "cifar100": (50_000, 10_000, (32, 32, 3), 100),
}
#: EMNIST's (train, test) examples per subset (Cohen et al., 2017)
EMNIST_SIZES: dict[str, tuple[int, int]] = {
    "byclass": (697_932, 116_323),
    "bymerge": (697_932, 116_323),
    "balanced": (112_800, 18_800),
    "letters": (124_800, 20_800),
    "digits": (240_000, 40_000),
    "mnist": (60_000, 10_000),
}
#: distinct random images a synthetic dataset repeats (generating 2.2 GB of EMNIST-byclass noise is slow)
_POOL = 4096


# ------------------------------------------------------------------------------------------------------
# Synthetic data of the real shapes (used inside the subprocesses)
# ------------------------------------------------------------------------------------------------------


def synthetic_dataset(name: str, split: str = "train", *, subset: str = "balanced"):
    """A :class:`sidejax.data.Dataset` with the real ``name``'s shapes and random content: as many examples
    as its ``split`` holds, NHWC ``float32`` images in ``[0, 1]`` (:data:`_POOL` distinct random images,
    repeated) and balanced ``int32`` labels in random order. Deterministic (the seed is fixed per split).

    Raises:
      ValueError: ``name`` is not a dataset that needs files (:data:`REAL_SHAPES`, ``emnist``).
    """
    import numpy as np

    from sidejax.data import EMNIST_SUBSETS, Dataset

    if name == "emnist":
        train_n, test_n = EMNIST_SIZES[subset]
        shape, classes = (28, 28, 1), EMNIST_SUBSETS[subset]
    elif name in REAL_SHAPES:
        train_n, test_n, shape, classes = REAL_SHAPES[name]
    else:
        raise ValueError(f"no synthetic stand-in for {name!r}: it needs no files")
    n = train_n if split == "train" else test_n
    rng = np.random.default_rng(0 if split == "train" else 1)
    pool = rng.random((min(_POOL, n), *shape), dtype=np.float32)
    x = np.resize(pool, (n, *shape))
    y = rng.permutation(np.arange(n) % classes).astype(np.int32)
    return Dataset(x, y, classes)


@contextmanager
def synthetic_datasets() -> Iterator[list[str]]:
    """Within the block, the experiment driver's dataset loader returns :func:`synthetic_dataset` for the
    datasets that need files (the others, e.g. ``digits``, load as usual). Yields the list of the datasets
    it replaced (appended to as they are loaded)."""
    from experiments import driver

    real = getattr(driver, "load_dataset", None)
    if real is None:
        raise RuntimeError(
            "experiments.driver has no load_dataset to replace: update experiments/gpu_check.py to the "
            "driver's data loading"
        )
    replaced: list[str] = []

    def load(name, split="train", **kwargs):
        if name in REAL_SHAPES or name == "emnist":
            replaced.append(name)
            return synthetic_dataset(name, split, subset=kwargs.get("subset", "balanced"))
        return real(name, split, **kwargs)

    driver.load_dataset = load
    try:
        yield replaced
    finally:
        driver.load_dataset = real


# ------------------------------------------------------------------------------------------------------
# Subprocess bodies (``--child``)
# ------------------------------------------------------------------------------------------------------


def device_facts() -> dict[str, Any]:
    """The backend, the devices and the versions (imports jax: run in a subprocess)."""
    import jax
    import jaxlib

    devices = []
    for d in jax.devices():
        stats = _memory_stats(d)
        devices.append(
            {
                "id": d.id,
                "platform": d.platform,
                "device_kind": getattr(d, "device_kind", None),
                "repr": str(d),
                "bytes_limit": stats.get("bytes_limit") if stats else None,
            }
        )
    try:
        info = jax.print_environment_info(return_string=True)
    except Exception as e:  # facts only; never fail the check for them
        info = f"unavailable: {e!r}"
    return {
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "device_kind": devices[0]["device_kind"] if devices else None,
        "devices": devices,
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "environment_info": info,
    }


def _memory_stats(device) -> dict[str, Any] | None:
    try:
        return device.memory_stats()
    except Exception:  # a backend without memory statistics
        return None


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def run_preset(preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Rounds 1 and 2 of ``preset`` (with ``overrides``) on synthetic data of the real shapes (see the
    module docstring); returns the preset's report entry. Imports jax: run in a subprocess."""
    import jax
    import numpy as np

    from experiments.algorithms import resolve_client_strategy
    from experiments.config import load_preset

    t_start = time.perf_counter()
    config = load_preset(preset)
    one_shot = config.method.one_shot
    config = config.override({**overrides, "run.rounds": 1 if one_shot else 2}, source="gpu_check")
    run, times = _preset_rounds(config)
    fed, (x_test, _) = run["fed"], run["test"]
    sizes = np.asarray(fed.num_examples)
    eval_s = _time_evaluation(config, run)
    stats = _memory_stats(jax.devices()[0])
    peak = stats.get("peak_bytes_in_use") if stats else None
    rounds_stats = run["rounds_stats"]
    entry = {
        "preset": preset,
        "algorithm": config.algorithm,
        "one_shot": one_shot,
        "data": {
            "dataset": config.data.dataset,
            "synthetic": bool(run["replaced"]),
            "train_shape": list(np.shape(fed.x)),
            "test_shape": list(np.shape(x_test)),
            "num_classes": int(np.asarray(fed.y).max()) + 1,
            "num_clients": int(sizes.shape[0]),
            "clients_per_round": config.clients_per_round,
            "examples_per_client": {
                "min": int(sizes.min()),
                "mean": float(sizes.mean()),
                "max": int(sizes.max()),
            },
            "partition": config.data.partition,
        },
        "model": config.data.model,
        "num_params": int(run["num_params"]),
        "client_strategy": resolve_client_strategy(config),
        **times,
        "steady_round": "round 1 again from the initial state (one-shot)" if one_shot else "round 2",
        "eval_s": eval_s,
        # every algorithm declares its evaluation (Algorithm.evaluation), and the global model's is timed
        "eval_note": None,
        **_round_facts(run["infos"], run["num_params"]),
        "backend": jax.default_backend(),
        "peak_bytes_in_use": int(peak) if peak is not None else None,
        "peak_bytes_in_use_rounds": int(rounds_stats["peak_bytes_in_use"])
        if rounds_stats and "peak_bytes_in_use" in rounds_stats
        else None,
        "bytes_limit": int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None,
        "memory_note": None
        if peak is not None
        else f"the {jax.default_backend()} backend reports no memory_stats(); see peak_rss_mb",
        "peak_rss_mb": _peak_rss_mb(),
        "wall_s": time.perf_counter() - t_start,
    }
    return entry


def _preset_rounds(config) -> tuple[dict[str, Any], dict[str, Any]]:
    """Prepares ``config`` on synthetic data (the driver's :func:`experiments.driver.prepare`), initialises
    it (jitted where it traces) and runs its round 1 and its steady round (round 2, or for a one-shot method
    round 1 again from the initial state). Returns what the report needs and the timings, in the report's
    order (``prepare_s``, ``init_s``, ``init_mode``, ``compile_and_first_round_s``, ``steady_round_s``)."""
    import jax

    from experiments.algorithms import client_map
    from experiments.driver import prepare
    from sidejax.fl import run_rounds
    from sidejax.keys import run_keys
    from sidejax.models import count_params, init_params

    t0 = time.perf_counter()
    with synthetic_datasets() as replaced:
        algorithm, spec, fed, test, _ = prepare(config)
    times: dict[str, Any] = {"prepare_s": time.perf_counter() - t0}
    init_key, rounds_key = run_keys(config.run.seed)
    num_clients = int(fed.num_examples.shape[0])
    t0 = time.perf_counter()
    try:  # jitted: op by op, the initialisations compile for seconds on a CPU
        params = jax.jit(lambda key: init_params(key, spec))(init_key)
        state0 = jax.jit(algorithm.init, static_argnums=2)(init_key, params, num_clients)
        init_mode = "jit"
    except Exception:  # an initialisation that does not trace runs as the driver runs it
        params = init_params(init_key, spec)
        state0 = algorithm.init(init_key, params, num_clients)
        init_mode = "eager"
    state0 = jax.block_until_ready(state0)
    times.update(init_s=time.perf_counter() - t0, init_mode=init_mode)

    cmap = client_map(config)
    t0 = time.perf_counter()
    state1, info1 = jax.block_until_ready(run_rounds(algorithm, rounds_key, state0, fed, 1, client_map=cmap))
    times["compile_and_first_round_s"] = time.perf_counter() - t0
    start = state0 if config.method.one_shot else state1  # a one-shot method has no round 2: its round again
    t0 = time.perf_counter()
    state2, info2 = jax.block_until_ready(run_rounds(algorithm, rounds_key, start, fed, 1, client_map=cmap))
    times["steady_round_s"] = time.perf_counter() - t0
    run = {
        "algorithm": algorithm,
        "spec": spec,
        "fed": fed,
        "test": test,
        "replaced": replaced,
        "num_params": count_params(params),
        "state": state2,
        "infos": (info1, info2),
        "rounds_stats": _memory_stats(jax.devices()[0]),
    }
    return run, times


def _time_evaluation(config, run: dict[str, Any]) -> float:
    """Seconds of the first evaluation (with its compilation) of the global model after the steady round,
    as the algorithm declares it (:func:`sidejax.fl.build_algorithm_evaluator`; personal models aside)."""
    import jax

    from sidejax.fl import build_algorithm_evaluator

    evaluation = run["algorithm"].evaluation._replace(personal=None)
    evaluate = build_algorithm_evaluator(
        evaluation, run["spec"].module.apply, batch_size=config.run.eval_batch_size
    )
    t0 = time.perf_counter()
    jax.block_until_ready(evaluate(run["state"], run["test"]))
    return time.perf_counter() - t0


def _round_facts(infos, num_params: int) -> dict[str, Any]:
    """The bits per round and the checks of the rounds' flags (``finite``, ``streams_valid``,
    ``stream_problems``), as the report has them."""
    import numpy as np

    from experiments.driver import stream_problems

    finite = all(
        bool(np.all(np.asarray(i.clients.finite)) and np.all(np.asarray(i.server_finite))) for i in infos
    )
    problems = [stream_problems(i) for i in infos]
    up = [np.asarray(i.uplink_bits, np.float64) for i in infos]
    down = [np.asarray(i.downlink_bits, np.float64) for i in infos]
    return {
        "uplink_bits": [float(u.sum()) for u in up],
        "downlink_bits": [float(d.sum()) for d in down],
        "uplink_bpp": [float(u.mean() / num_params) for u in up],
        "downlink_bpp": [float(d.mean() / num_params) for d in down],
        "finite": finite,
        "streams_valid": all(p is None for p in problems),
        "stream_problems": "; ".join(f"round {r}: {what}" for r, what in filter(None, problems)) or None,
    }


def run_bench_synthetic(name: str, argv: list[str]) -> None:
    """Runs ``experiments.bench.<name>.main(argv)`` with :func:`synthetic_datasets` installed."""
    import importlib

    module = importlib.import_module(f"experiments.bench.{name}")
    with synthetic_datasets():
        module.main(argv)


def _child(kind: str, args_json: str) -> int:
    args = json.loads(args_json) if args_json else {}
    try:
        if kind == "facts":
            result = device_facts()
        elif kind == "preset":
            result = run_preset(args["preset"], args.get("overrides", {}))
        elif kind == "bench":
            run_bench_synthetic(args["name"], args["argv"])
            return 0
        else:
            raise ValueError(f"unknown --child {kind!r}")
    except Exception as e:
        traceback.print_exc()
        print(RESULT_TAG + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------
# The parent: subprocesses, budget, report
# ------------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """A finished subprocess: ``returncode`` (``None`` on a timeout), its output and duration."""

    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, chars: int = 3000) -> str:
        return (self.stdout[-chars // 2 :] + "\n--- stderr ---\n" + self.stderr[-chars // 2 :]).strip()

    def result(self) -> dict[str, Any] | None:
        """The JSON after :data:`RESULT_TAG` on the last line that has it."""
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        return json.loads(lines[-1][len(RESULT_TAG) :]) if lines else None


def child_env() -> dict[str, str]:
    """The subprocesses' environment: this one, with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def run_subprocess(cmd: list[str], timeout_s: float) -> Proc:
    """Runs ``cmd`` in the repository root in its own process group; on a timeout (or an interrupt) the
    whole group is killed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=max(timeout_s, 1.0))
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        code = None
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    return Proc(code, out, err, time.perf_counter() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Budget:
    """The run's time budget, counted from its construction."""

    def __init__(self, total_s: float):
        self.total_s = total_s
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.total_s - self.elapsed() - REPORT_RESERVE_S

    def grant(self, cap_s: float, min_s: float, keep_s: float = 0.0) -> tuple[float | None, str | None]:
        """``(timeout, None)`` for an item that may run at most ``cap_s`` and needs ``min_s``, keeping
        ``keep_s`` for what must still run after it; ``(None, reason)`` when it does not fit."""
        available = self.left() - keep_s
        if available < min_s:
            kept = f", {keep_s:.0f} s kept for the presets after it" if keep_s else ""
            return None, (
                f"budget: {max(self.left(), 0):.0f} s of {self.total_s:.0f} s left{kept}; it needs at least "
                f"{min_s:.0f} s"
            )
        return min(cap_s, available), None


def _judge_preset(proc: Proc, entry: dict[str, Any]) -> tuple[str, str | None]:
    """A preset subprocess's ``(status, reason)``; its result joins ``entry``. It fails on an error, a
    non-finite loss or parameter, or an invalid stream."""
    result = proc.result()
    if not result or "error" in result or proc.returncode != 0:
        return "error", (result or {}).get("error") or f"exit code {proc.returncode}, no result"
    entry.update(result)
    problems = [] if result["finite"] else ["non-finite"]
    problems += [] if result["streams_valid"] else [f"invalid stream ({result['stream_problems']})"]
    return ("failed" if problems else "ok"), ", ".join(problems) or None


def _judge_bench(path: Path, proc: Proc, entry: dict[str, Any]) -> tuple[str, str | None]:
    """A benchmark subprocess's ``(status, reason)``; the JSON it wrote at ``path`` joins ``entry``."""
    if proc.returncode != 0 or not path.is_file():
        return "error", f"exit code {proc.returncode}" + ("" if path.is_file() else ", no JSON written")
    entry["result"] = json.loads(path.read_text())
    return "ok", None


class Check:
    """The run: its report, written after every section."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out: Path = args.output
        self.budget = Budget(args.budget_s)
        self.quick: bool = args.quick
        self.preset_min_s = 10.0 if self.quick else 20.0
        self.report: dict[str, Any] = {
            "schema": "sidejax-gpu-check/1",
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "finished": None,
            "mode": "quick" if self.quick else "full",
            "budget_s": args.budget_s,
            "argv": sys.argv[1:] if args.argv is None else args.argv,
            "accelerator": None,
            "note": None,
            "device": None,
            "environment": environment(),
            "tests": None,
            "presets": {},
            "benchmarks": {},
            "skipped": [],
            "failures": [],
            "ok": None,
            "wall_s": None,
        }

    # -- bookkeeping ------------------------------------------------------------------------------------

    def skip(self, section: str, item: str, reason: str) -> dict[str, Any]:
        self.report["skipped"].append({"section": section, "item": item, "reason": reason})
        print(f"  skipped {section} {item}: {reason}", flush=True)
        return {"status": "skipped", "reason": reason}

    def fail(self, section: str, item: str, reason: str) -> None:
        self.report["failures"].append({"section": section, "item": item, "reason": reason})

    def write(self) -> None:
        self.report["wall_s"] = round(self.budget.elapsed(), 2)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (REPORT + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        tmp.replace(self.out / REPORT)

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def preset_checks(self) -> list[PresetCheck]:
        if not self.args.presets:
            return list(QUICK_PRESETS if self.quick else PAPER_PRESETS)
        table = {p.preset: p for p in (*PAPER_PRESETS, *QUICK_PRESETS)}
        checks = []
        for name in self.args.presets:
            if name in table:
                checks.append(table[name])
            elif name.startswith("bpcfl_emnist_bpcfl_"):  # any BPC-FL EMNIST preset needs the same cuts
                checks.append(replace(_BPCFL_GPU, preset=name))
            else:
                checks.append(PresetCheck(_paper_of(name), name))
        return checks

    # -- sections ---------------------------------------------------------------------------------------

    def device(self) -> None:
        print("device ...", flush=True)
        proc = run_subprocess(self.python("-m", "experiments.gpu_check", "--child", "facts"), 120.0)
        facts = proc.result() if not proc.timed_out else None
        if not facts or "error" in facts:
            facts = {"error": (facts or {}).get("error", "no result"), "output_tail": proc.tail()}
            self.report["device"] = facts
            self.report["accelerator"] = False
            self.report["note"] = "the device facts could not be read (see device.error)"
            self.fail("device", "facts", facts["error"])
            return
        self.report["device"] = facts
        accelerator = facts["backend"] != "cpu"
        self.report["accelerator"] = accelerator
        if not accelerator:
            self.report["note"] = (
                "no accelerator found (jax.default_backend() is 'cpu'): every figure in this report is a "
                "CPU figure"
            )
            print(f"NOTE: {self.report['note']}", flush=True)
        print(
            f"  backend {facts['backend']}, {facts['device_count']} x {facts['device_kind']}, "
            f"jax {facts['jax_version']}",
            flush=True,
        )

    def tests(self) -> None:
        section = "tests"
        if self.args.skip_tests:
            self.report["tests"] = self.skip(section, "pytest", "--skip-tests")
            return
        paths = list(self.args.tests or (QUICK_TESTS if self.quick else ACCELERATOR_TESTS))
        missing = [p for p in paths if not (ROOT / p).exists()]
        keep = len(self.preset_checks()) * self.preset_min_s
        timeout, reason = self.budget.grant(60.0 if self.quick else 210.0, 15.0, keep)
        if timeout is None:
            self.report["tests"] = self.skip(section, "pytest", reason)
            return
        print(f"tests: {len(paths)} files, timeout {timeout:.0f} s ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "junit.xml"
            # -v: one line per test as it ends, so that a run cut off by its timeout still names its failures
            cmd = self.python("-m", "pytest", *paths, "-m", TEST_MARKERS, "-p", "no:cacheprovider", "-v")
            cmd += ["--tb=short", "-rfE"]
            workers = self.test_workers()
            if workers:
                cmd += ["-n", str(workers), "--dist", "loadfile"]
            cmd += ["--junitxml", str(junit)]
            proc = run_subprocess(cmd, timeout)
            counts, failed = _junit_counts(junit) if junit.is_file() else (None, [])
        if not failed:  # no JUnit XML (timeout): the failures pytest printed so far
            failed = sorted(set(re.findall(r"(?:FAILED|ERROR) (\S+::\S+)", proc.stdout or "")))
        log = self.out / "tests.log"
        log.write_text((proc.stdout or "") + "\n--- stderr ---\n" + (proc.stderr or ""))
        entry: dict[str, Any] = {
            "paths": paths,
            "missing_paths": missing,
            "command": " ".join(cmd[1:]).replace(str(junit), "<junit.xml>"),
            "workers": workers,
            "timeout_s": round(timeout, 1),
            "duration_s": round(proc.duration_s, 2),
            "returncode": proc.returncode,
            "counts": counts,
            "failed_tests": failed[:100],
            "log": str(log),  # pytest's whole output
        }
        if proc.timed_out:
            entry["status"] = "timeout"
            reason = f"pytest ran past its {timeout:.0f} s timeout"
        elif proc.returncode == 0 and counts and counts["passed"] > 0:
            entry["status"] = "passed"
            reason = None
        elif proc.returncode == 5:
            entry["status"] = "failed"
            reason = "pytest collected no tests (exit code 5)"
        else:
            entry["status"] = "failed" if proc.returncode == 1 else "error"
            reason = f"pytest exit code {proc.returncode}" + (
                f": {counts['failed']} failed, {counts['errors']} errors" if counts else ""
            )
        if reason:
            entry["reason"] = reason
            entry["output_tail"] = proc.tail(6000)
            self.fail(section, "pytest", reason)
        self.report["tests"] = entry
        print(f"  {entry['status']} in {proc.duration_s:.1f} s: {counts}", flush=True)

    def test_workers(self) -> int:
        if self.args.test_workers is not None:
            return self.args.test_workers
        import importlib.util

        if not self.report["accelerator"] or importlib.util.find_spec("xdist") is None:
            return 0
        return max(1, min(4, (os.cpu_count() or 1) // 4))  # compilation is CPU work; the device is shared

    def attempt(self, section: str, key: str, cmd: list[str], timeout: float, entry: dict, judge) -> dict:
        """Runs ``cmd`` (at most ``timeout`` seconds) for ``section``'s item ``key`` and completes its report
        ``entry``: the timeout, the duration, the exit code, then the ``status``: ``timeout``, or what
        ``judge(proc, entry)`` returns as ``(status, reason)`` (it may add to ``entry``). A reason makes the
        item a failure, with the end of its output in the entry. Returns the entry."""
        proc = run_subprocess(cmd, timeout)
        entry.update(timeout_s=round(timeout, 1), duration_s=round(proc.duration_s, 2))
        entry["returncode"] = proc.returncode
        if proc.timed_out:
            entry["status"], reason = "timeout", f"ran past its {timeout:.0f} s timeout"
        else:
            entry["status"], reason = judge(proc, entry)
        if reason:
            entry["reason"], entry["output_tail"] = reason, proc.tail()
            self.fail(section, key, reason)
        return entry

    def presets(self) -> None:
        section = "presets"
        checks = self.preset_checks()
        for i, check in enumerate(checks):
            key = (
                check.paper if check.paper not in self.report["presets"] else f"{check.paper}:{check.preset}"
            )
            keep = (len(checks) - i - 1) * self.preset_min_s
            timeout, reason = self.budget.grant(check.cap_s, self.preset_min_s, keep)
            base = {"preset": check.preset, "overrides": check.overrides, "why": check.why or None}
            if timeout is None:
                self.report["presets"][key] = {**base, **self.skip(section, key, reason)}
                continue
            print(f"preset {key}: {check.preset}, timeout {timeout:.0f} s ...", flush=True)
            payload = json.dumps({"preset": check.preset, "overrides": check.overrides})
            cmd = self.python("-m", "experiments.gpu_check", "--child", "preset", "--child-args", payload)
            entry = self.attempt(section, key, cmd, timeout, base, _judge_preset)
            self.report["presets"][key] = entry
            print(f"  {entry['status']}: {_preset_line(entry)}", flush=True)
            self.write()

    def bench_list(self) -> list[Bench]:
        """:data:`BENCHMARKS`, with ``sharding`` over the devices present when there are two or more (else
        recorded as skipped); the scripts of :data:`NOT_RUN_BENCHMARKS` recorded as skipped."""
        for name, reason in NOT_RUN_BENCHMARKS.items():
            self.report["benchmarks"][name] = self.skip("benchmarks", name, reason)
        devices = (self.report["device"] or {}).get("device_count") or 1
        if devices < 2:
            reason = "one device: nothing to split (tests/fl/test_sharding.py ran on it)"
            self.report["benchmarks"]["sharding"] = self.skip("benchmarks", "sharding", reason)
            return list(BENCHMARKS)
        counts = "--devices " + ",".join(str(n) for n in (1, 2, 4, 8) if n <= devices)
        why = "one round with the participants split over the devices present"
        return [*BENCHMARKS, Bench("sharding", f"{counts} --repeats 1", f"{counts} --quick", "--out", why)]

    def benchmarks(self) -> None:
        section = "benchmarks"
        if self.args.skip_benchmarks:
            self.skip(section, "all", "--skip-benchmarks")
            return
        for bench in self.bench_list():
            if self.quick and bench.quick is None:
                reason = "--quick: compiles for most of a minute on a 2-core CPU; runs in the full check"
                self.report["benchmarks"][bench.name] = self.skip(section, bench.name, reason)
                continue
            timeout, reason = self.budget.grant(bench.cap_s, 10.0)
            if timeout is None:
                self.report["benchmarks"][bench.name] = self.skip(section, bench.name, reason)
                continue
            path = self.out / "bench" / f"{bench.name}.json"
            argv = [*(bench.quick if self.quick else bench.full).split(), bench.out_flag, str(path.resolve())]
            if bench.synthetic:
                payload = json.dumps({"name": bench.name, "argv": argv})
                cmd = self.python("-m", "experiments.gpu_check", "--child", "bench", "--child-args", payload)
            else:
                cmd = self.python("-m", f"experiments.bench.{bench.name}", *argv)
            print(f"benchmark {bench.name}, timeout {timeout:.0f} s ...", flush=True)
            path.unlink(missing_ok=True)
            entry = {"why": bench.why, "command": " ".join(cmd[1:]), "json": str(path)}
            entry = self.attempt(
                section, bench.name, cmd, timeout, entry, functools.partial(_judge_bench, path)
            )
            self.report["benchmarks"][bench.name] = entry
            print(f"  {entry['status']} in {entry['duration_s']:.1f} s", flush=True)
            self.write()

    # -- the run ----------------------------------------------------------------------------------------

    def run(self) -> int:
        print(
            f"gpu_check ({self.report['mode']}, budget {self.budget.total_s:.0f} s) -> {self.out / REPORT}",
            flush=True,
        )
        for step in (self.device, self.tests, self.presets, self.benchmarks):
            step()
            self.write()
        hard = [f for f in self.report["failures"] if f["section"] in ("tests", "presets", "device")]
        self.report["ok"] = not self.report["failures"]
        self.report["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
        self.write()
        print(summary(self.report))
        print(f"wrote {self.out / REPORT}")
        return 1 if hard else 0


def environment() -> dict[str, Any]:
    """Where the check ran: python, machine, the environment variables that change JAX's behaviour, the
    git commit and whether tracked files differ from it (``None`` outside a checkout)."""

    def git(*args: str) -> str | None:
        try:  # --no-optional-locks: reading the status must not rewrite the index
            proc = subprocess.run(
                ["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = (git("rev-parse", "HEAD") or "").strip()
    status = git("status", "--porcelain", "--untracked-files=no")
    names = "XLA_FLAGS XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION JAX_PLATFORMS "
    names += "JAX_COMPILATION_CACHE_DIR CUDA_VISIBLE_DEVICES"
    env = child_env()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_commit": commit or None,
        "git_dirty": None if status is None else bool(status.strip()),
        "subprocess_env": {n: env.get(n) for n in names.split()},
    }


def _paper_of(preset: str) -> str:
    for prefix, paper in _PAPER_OF_PREFIX.items():
        if preset.startswith(prefix):
            return paper
    return preset


def _junit_counts(path: Path) -> tuple[dict[str, int] | None, list[str]]:
    """``({passed, failed, errors, skipped, total}, failed test ids)`` from pytest's JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None, []
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname', '')}::{case.get('name', '')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {
        "passed": totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"],
        "failed": totals["failures"],
        "errors": totals["errors"],
        "skipped": totals["skipped"],
        "total": totals["tests"],
    }
    return counts, failed


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _short(text: str, chars: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _preset_line(e: dict[str, Any]) -> str:
    if "compile_and_first_round_s" not in e:
        return _short(e.get("reason", ""))
    peak = _gib(e["peak_bytes_in_use"]) if e["peak_bytes_in_use"] is not None else "n/a"
    return (
        f"compile+round 1 {e['compile_and_first_round_s']:.1f} s, round {e['steady_round_s']:.2f} s, "
        f"uplink {e['uplink_bpp'][-1]:.4g} bpp, peak {peak} (host RSS {e['peak_rss_mb']:.0f} MB)"
    )


def summary(report: dict[str, Any]) -> str:
    """A short table of the report."""
    dev = report["device"] or {}
    lines = [
        "",
        f"gpu_check summary ({report['mode']}): backend {dev.get('backend', '?')}, "
        f"{dev.get('device_count', '?')} x {dev.get('device_kind', '?')}, jax {dev.get('jax_version', '?')}; "
        f"{report['wall_s']:.0f} s of the {report['budget_s']:.0f} s budget",
    ]
    if report["note"]:
        lines.append(f"NOTE: {report['note']}")
    rows = [("section", "item", "status", "time s", "detail")]
    t = report["tests"] or {}
    counts = t.get("counts") or {}
    detail = ", ".join(f"{v} {k}" for k, v in counts.items() if k != "total")
    if t.get("reason"):
        detail = f"{detail}; {_short(t['reason'])}" if detail else _short(t["reason"])
    rows.append(("tests", "pytest", t.get("status", "-"), _secs(t.get("duration_s")), detail))
    for key, e in report["presets"].items():
        rows.append(("preset", key, e["status"], _secs(e.get("duration_s")), _preset_line(e)))
    for name, e in report["benchmarks"].items():
        detail = e.get("json", "") if e["status"] == "ok" else _short(e.get("reason", ""))
        rows.append(("bench", name, e["status"], _secs(e.get("duration_s")), detail))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    if report["failures"]:
        lines.append(
            "failures: "
            + "; ".join(f"{f['section']} {f['item']}: {_short(f['reason'])}" for f in report["failures"])
        )
    return "\n".join(lines)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


#: the command line: flag -> (type, default, help) (:func:`experiments.bench.common.parser`)
FLAGS = {
    "--output": (Path, DEFAULT_OUTPUT, f"report folder (default {DEFAULT_OUTPUT})"),
    "--overwrite": (bool, False, "replace a gpu_check.json already in --output"),
    "--quick": (bool, False, "reduced settings: about 2 minutes on a 2-core CPU"),
    "--skip-tests": (bool, False, "do not run the tests section"),
    "--skip-benchmarks": (bool, False, "do not run the benchmarks section"),
    "--budget-s": (float, DEFAULT_BUDGET_S, f"the whole run's time limit (default {DEFAULT_BUDGET_S:.0f})"),
    "--presets": ([str], None, "presets to run instead of one per paper"),
    "--tests": ([str], None, "test paths to run instead of the default subset"),
    "--test-workers": (int, None, "pytest-xdist workers (default: up to 4 with an accelerator, 0 without)"),
    "--child": (str, None, argparse.SUPPRESS),
    "--child-args": (str, "", argparse.SUPPRESS),
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("experiments.gpu_check", __doc__, FLAGS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.budget_s <= REPORT_RESERVE_S:
        p.error(f"--budget-s must exceed {REPORT_RESERVE_S:.0f}")
    if args.test_workers is not None and args.test_workers < 0:
        p.error("--test-workers must be >= 0")
    unknown = [
        n for n in args.presets or () if not (ROOT / "experiments" / "presets" / f"{n}.toml").is_file()
    ]
    if unknown:
        p.error(f"--presets: unknown {unknown} (python -m experiments.run --list-presets lists them)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child:
        return _child(args.child, args.child_args)
    if (args.output / REPORT).exists() and not args.overwrite:
        print(
            f"{args.output / REPORT} already exists: pass --overwrite to replace it, or choose another "
            "--output",
            file=sys.stderr,
        )
        return 2
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
