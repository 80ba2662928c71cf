"""Runs one experiment: data, model, algorithm, chunks of jitted rounds, evaluation, files, checkpoints.

:func:`run_experiment` puts together the driver's modules, each one part of a run:

- :mod:`experiments.driver_folder`: the results folder and its one rule (a new run writes only into a new
  or empty folder unless ``overwrite``; ``resume`` needs a run of the same configuration there);
- :mod:`experiments.driver_loop`: the initial state and the round loop (chunks of ``run.eval_every`` rounds,
  each checked for NaN/inf and invalid streams before it is kept);
- :mod:`experiments.driver_eval`: the evaluation the algorithm declares (its ``evaluation``: one model, an
  ensemble of samples, and personal per-client models), by :func:`sidejax.fl.build_algorithm_evaluator`;
- :mod:`experiments.driver_records`: the metrics rows, checkpoints, final model and summary;
- :mod:`experiments.driver_plots`: the accuracy plots.

The names other modules use from them are importable from here too.

Output folder layout::

    config.json                  the ExperimentConfig the run was started with, its [run], [data],
                                 [method] and [coder] tables (plus the derived algorithm name,
                                 clients_per_round and num_params); never rewritten by --resume
    metrics.jsonl                one JSON object per round (appended as rounds finish)
    metrics.csv                  the same table as CSV (rewritten after every chunk)
    summary.json                 final/best/last-5-mean accuracy (and personal accuracy, for a personalized
                                 method), total bits, rounds run and target, wall time
    accuracy_vs_round.png        test accuracy against round
    accuracy_vs_bits.png         test accuracy against cumulative bits, uplink + downlink
    accuracy_vs_uplink_bits.png  test accuracy against cumulative uplink bits: what compression saves (the
                                 total is dominated by the 32-bit downlink broadcast that every method pays)
    resume_log.jsonl             one line per --resume: time, round resumed from, target rounds
    checkpoint/state.ckpt        the last good RoundState and the metrics rows up to it, one atomic
                                 checksummed file (see experiments.checkpoint); --resume continues from it
    final_params/                the final model (the evaluated parameters, or an ensemble's first sample)

Bits in the metrics are the lengths of the messages the algorithm built (``RoundInfo``), summed over the
participants; ``*_bpp`` columns are bits per parameter per participating client. What is evaluated, and on
which test set: :mod:`experiments.driver_eval`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import distributed
from experiments.algorithms import ModelContext, build_algorithm
from experiments.config import ExperimentConfig
from experiments.driver_eval import Evaluator, check_evaluation
from experiments.driver_folder import (
    RunExistsError,
    check_new_output,
    check_output,
    check_resumable_folder,
    is_run_folder,
    run_config,
    same_run_config,
)
from experiments.driver_loop import (
    InvalidStreamError,
    NonFiniteError,
    host_view,
    lost_process,
    run_chunks,
    start_rounds,
    stream_problems,
)
from experiments.driver_plots import PLOT_FILES, accuracy_figures, plot_runs
from experiments.driver_records import (
    METRIC_COLUMNS,
    PERSONAL_COLUMNS,
    PERSONAL_TABLE_HEADER,
    TABLE_HEADER,
    Records,
    RunSummary,
    read_jsonl,
    tail_accuracy,
)
from sidejax.data import label_split_train_test, load_dataset, make_federated_data, partition
from sidejax.fl import classification_loss, place_federation
from sidejax.models import get_model, init_params

__all__ = [
    "InvalidStreamError",
    "NonFiniteError",
    "RunExistsError",
    "RunSummary",
    "ClientTestSets",
    "Prepared",
    "prepare",
    "run_experiment",
    "is_run_folder",
    "check_new_output",
    "same_run_config",
    "check_resumable_folder",
    "run_config",
    "stream_problems",
    "accuracy_figures",
    "plot_runs",
    "read_jsonl",
    "tail_accuracy",
    "METRIC_COLUMNS",
    "PERSONAL_COLUMNS",
    "PERSONAL_TABLE_HEADER",
    "TABLE_HEADER",
    "PLOT_FILES",
]


class ClientTestSets(NamedTuple):
    """Every client's own test set, zero-padded to the largest: client ``c``'s examples are
    ``x[c][mask[c]]``, ``y[c][mask[c]]`` (the layout of :func:`sidejax.fl.build_personal_evaluator`).

    Attributes:
      x: ``[clients, n_max, ...]`` inputs.
      y: ``[clients, n_max]`` labels.
      mask: ``[clients, n_max]`` bool, True on a client's real examples.
    """

    x: jax.Array
    y: jax.Array
    mask: jax.Array


class Prepared(NamedTuple):
    """What :func:`prepare` builds, arrays on the default device.

    Attributes:
      algorithm: the :class:`sidejax.fl.Algorithm`.
      spec: the model spec.
      fed: the clients' training data (:class:`sidejax.data.FederatedData`).
      test: ``(x_test, y_test)``, the test set the global model is evaluated on: the dataset's test split,
        or with partition pfedme the union of the clients' test sets.
      client_test: the per-client test sets (:class:`ClientTestSets`) of partition pfedme, else ``None``.
    """

    algorithm: Any
    spec: Any
    fed: Any
    test: tuple[jax.Array, jax.Array]
    client_test: ClientTestSets | None


def _padded_client_sets(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> ClientTestSets:
    n_max = max(p.size for p in parts)
    xs = np.zeros((len(parts), n_max, *x.shape[1:]), x.dtype)
    ys = np.zeros((len(parts), n_max), y.dtype)
    mask = np.zeros((len(parts), n_max), bool)
    for c, idx in enumerate(parts):
        xs[c, : idx.size], ys[c, : idx.size], mask[c, : idx.size] = x[idx], y[idx], True
    return ClientTestSets(jnp.asarray(xs), jnp.asarray(ys), jnp.asarray(mask))


def prepare(config: ExperimentConfig) -> Prepared:
    """Loads and partitions the data, builds the model and the algorithm.

    With ``data.partition = "pfedme"`` the dataset's train and test splits are pooled and split by
    :func:`sidejax.data.label_split_train_test` into a train and a test set per client; the global test set
    is the union of the clients' test sets. Any other partition splits the training set
    (:func:`sidejax.data.partition`) and tests on the dataset's test split.

    Returns:
      a :class:`Prepared` ``(algorithm, spec, fed, (x_test, y_test), client_test)``.
    """
    data, seed = config.data, config.run.seed
    train = load_dataset(data.dataset, "train", **data.dataset_kwargs())
    test = load_dataset(data.dataset, "test", **data.dataset_kwargs())
    client_test = None
    if data.per_client_test:
        if data.train_subset is not None:  # DataConfig refuses it; a guard for hand-built configs
            raise ValueError("data.train_subset is not used with data.partition 'pfedme'")
        x, y = np.concatenate([train.x, test.x]), np.concatenate([train.y, test.y])
        parts, test_parts = label_split_train_test(y, data.num_clients, seed=seed, **data.partition_kwargs())
        client_test = _padded_client_sets(x, y, test_parts)
        pooled = np.concatenate(test_parts)
        x_test, y_test = x[pooled], y[pooled]
    else:
        x, y = train.x, train.y
        if data.train_subset is not None:
            if data.train_subset > len(y):
                raise ValueError(
                    f"data.train_subset={data.train_subset} exceeds the {len(y)} training examples"
                )
            keep = np.sort(np.random.default_rng(seed).permutation(len(y))[: data.train_subset])
            x, y = x[keep], y[keep]
        parts = partition(data.partition, y, data.num_clients, seed=seed, **data.partition_kwargs())
        x_test, y_test = test.x, test.y
    config.method.check_data(
        [len(p) for p in parts]
    )  # e.g. BPC-FL: a pseudocoreset larger than a client's data
    fed = make_federated_data(x, y, parts)
    spec = get_model(data.model, num_classes=train.num_classes, input_shape=tuple(x.shape[1:]))
    extra = {}
    if config.method.needs_model:  # BPC-FL: shared initialisations, the inputs' shape
        extra["model"] = ModelContext(
            lambda key: init_params(key, spec), tuple(x.shape[1:]), train.num_classes
        )
    algorithm = build_algorithm(config, classification_loss(spec.module.apply), **extra)
    return Prepared(algorithm, spec, fed, (jnp.asarray(x_test), jnp.asarray(y_test)), client_test)


def run_experiment(
    config: ExperimentConfig,
    output_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    verbose: bool = True,
    label: str | None = None,
) -> RunSummary:
    """Runs (or resumes) one experiment and writes its results folder.

    Rules for the folder: a new run refuses a folder that holds anything (:func:`check_new_output`)
    unless ``overwrite`` (which removes that run's files once the new run's data and model are built);
    ``resume`` needs a run with a checkpoint there and checks it before any work, creating nothing.
    ``config.json`` is the configuration the run was started with and is never rewritten by a resume;
    ``config.run.rounds`` is the target: resuming with a larger one extends the run, and each resume appends
    ``{"time", "from_round", "rounds"}`` to ``resume_log.jsonl`` (the target is also kept in the
    checkpoint as ``rounds_target`` and in ``summary.json``).

    Args:
      config: the experiment.
      output_dir: results folder (created).
      resume: continue from ``output_dir/checkpoint`` (the config must match, except ``run.rounds``,
        which must not be below the rounds already done).
      overwrite: replace a run already in ``output_dir``.
      progress: show a tqdm progress bar over rounds.
      verbose: print the per-round table.
      label: the run's name in plots (default: the algorithm name).

    Raises:
      NonFiniteError: a NaN/inf appeared; the last good state is checkpointed first.
      InvalidStreamError: a stream was invalid; the last good state is checkpointed first.
      RunExistsError: ``output_dir`` holds a run and neither ``resume`` nor ``overwrite`` is set.
      FileNotFoundError: ``resume`` without a run to resume in ``output_dir``.
      CheckpointError: ``resume`` from a damaged or inconsistent checkpoint.
      ValueError: bad configuration, or ``resume`` with a different configuration.
    """
    out = Path(output_dir)
    distributed.start(config.run)  # several processes: join them (before JAX starts its backend)
    writer = distributed.is_writer()  # only process 0 writes the folder
    check_output(out, config, resume=resume, overwrite=overwrite)
    # several processes: the same configuration everywhere, and a barrier (every process has checked the
    # folder before process 0 writes to it)
    distributed.check_same_config(config)
    t_start = time.perf_counter()

    prepared = prepare(config)
    check_evaluation(config, prepared.algorithm, prepared.client_test)
    state, num_params, rounds = start_rounds(config, prepared)
    records = Records(out, config, num_params, writer=writer, t_start=t_start)
    partial_like = (lambda: rounds.partial_like(state)) if rounds.in_parts() else None
    state = records.open(state, resume=resume, overwrite=overwrite, partial_like=partial_like)
    # a mesh: the examples and the client state go to the devices that hold them (each process places its
    # own devices' shares); host_view gives the whole state back for evaluation and checkpoints
    state, fed = place_federation(rounds.client_map, state, rounds.fed)
    evaluator = Evaluator(
        prepared.algorithm,
        prepared.spec.module.apply,
        batch_size=config.run.eval_batch_size,
        test=prepared.test,
        client_test=prepared.client_test,
    )
    progress, verbose = progress and writer, verbose and writer
    with lost_process(config, records):
        state = run_chunks(
            config, rounds._replace(fed=fed), state, evaluator, records, progress=progress, verbose=verbose
        )
        final, sample = evaluator.final_model(host_view(config, state))  # a collective on several processes
    records.save_final(final, sample)
    return records.finish(personal=evaluator.personal, label=label)
