"""Runs one experiment: data, model, algorithm, chunks of jitted rounds, evaluation, files, checkpoints.

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

Bits in the metrics are the lengths of the messages the algorithm built (``RoundInfo``), summed over the
participants; ``*_bpp`` columns are bits per parameter per participating client.

``test_accuracy``/``test_loss`` are the global model's (``algorithm.eval_params``) on the test set: the
dataset's test split, or with ``data.partition = "pfedme"`` the union of the clients' test sets. A
personalized method (``algorithm.personal_params``, which needs ``pfedme``'s per-client test sets) also logs
:data:`PERSONAL_COLUMNS`: every client's personal model on its own test set, pooled over the clients
(correct predictions / examples, docs/papers/coreset_pfedbayes.md#s2-6).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import checkpoint, distributed
from experiments.algorithms import ModelContext, build_algorithm, client_map
from experiments.checkpoint import CheckpointError, checkpoint_exists, load_checkpoint, save_checkpoint
from experiments.config import TABLES, ExperimentConfig, OldConfigError, config_from_dict
from sidejax.coding import stream_errors
from sidejax.data import label_split_train_test, load_dataset, make_federated_data, partition
from sidejax.fl import (
    build_ensemble_evaluator,
    build_evaluator,
    build_personal_evaluator,
    build_round_step,
    classification_loss,
    client_mean,
    gather_to_host,
    place_federation,
    run_rounds,
)
from sidejax.keys import round_key, run_keys
from sidejax.models import count_params, get_model, init_params

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
    "METRIC_COLUMNS",
    "PERSONAL_COLUMNS",
]

#: the columns every run logs; an algorithm's own metrics (its ``metrics`` hook) follow them, a ``*_bits``
#: metric (mean per participant) logged as ``*_bpp`` (per parameter)
METRIC_COLUMNS = (
    "round",
    "test_accuracy",
    "test_loss",
    "test_ece",
    "train_loss",
    "uplink_bpp",
    "downlink_bpp",
    "broadcast_bpp",
    "uplink_bits",
    "downlink_bits",
    "cumulative_bits",
    "cumulative_uplink_bits",
    "wall_time_s",
)

#: the columns a personalized method (``algorithm.personal_params``) logs besides :data:`METRIC_COLUMNS`:
#: the personal models, each on its client's test set, pooled over the clients (``None`` in rounds that
#: are not evaluated)
PERSONAL_COLUMNS = ("personal_accuracy", "personal_loss")


TAIL_EVALS = 5
"""``tail_accuracy`` is the mean test accuracy of the last this-many evaluations: methods that evaluate a
sampled network (FedPM's ``m ~ Bern(theta)``) move by several points from one evaluation to the next, so a
single final number is a poor basis for comparing two runs."""


def tail_accuracy(accuracies: list[float]) -> float | None:
    """Mean of the last :data:`TAIL_EVALS` test accuracies (``None`` if there are none)."""
    tail = accuracies[-TAIL_EVALS:]
    return float(np.mean(tail)) if tail else None


#: the derived values ``config.json`` holds besides the config's tables
DERIVED_KEYS = ("algorithm", "clients_per_round", "num_params")


def run_config(saved: dict[str, Any], *, source: str = "config.json") -> ExperimentConfig:
    """The :class:`ExperimentConfig` of a run folder's ``config.json`` (derived values dropped).

    Raises:
      OldConfigError: a flat ``config.json``, written by a sidejax version before the sectioned config.
      ValueError: any other bad content.
    """
    if any(t in saved for t in TABLES):
        saved = {k: v for k, v in saved.items() if k not in DERIVED_KEYS}
    try:
        return config_from_dict(saved, source=source)
    except OldConfigError:
        raise OldConfigError(
            f"{source} was written by an older sidejax version (a flat config, before the [run], [data], "
            f"[method] and [coder] tables): this version cannot resume or re-read the run; start it again "
            f"(--overwrite), or use the version that wrote it"
        ) from None


class NonFiniteError(FloatingPointError):
    """Raised when a loss or a parameter becomes NaN/inf; names the first round and clients affected."""


class InvalidStreamError(RuntimeError):
    """Raised when the server found a client's KLMS stream malformed; names the first round and clients."""


@dataclass
class RunSummary:
    output_dir: Path
    rounds_run: int
    final_accuracy: float
    best_accuracy: float
    tail_accuracy: float
    total_bits: float
    mean_uplink_bpp: float
    mean_downlink_bpp: float
    mean_broadcast_bpp: float | None
    metrics: list[dict[str, Any]]
    #: a personalized method's personal accuracy (final, best, last-5 mean); ``None`` for other methods
    final_personal_accuracy: float | None = None
    best_personal_accuracy: float | None = None
    tail_personal_accuracy: float | None = None


def _mean_or_none(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


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
    check_data = getattr(config.method, "check_data", None)
    if check_data is not None:  # e.g. BPC-FL: a pseudocoreset larger than a client's data
        check_data([len(p) for p in parts])
    fed = make_federated_data(x, y, parts)
    spec = get_model(data.model, num_classes=train.num_classes, input_shape=tuple(x.shape[1:]))
    extra = {}
    if getattr(config.method, "needs_model", False):  # BPC-FL: shared initialisations, the inputs' shape
        extra["model"] = ModelContext(
            lambda key: init_params(key, spec), tuple(x.shape[1:]), train.num_classes
        )
    algorithm = build_algorithm(config, classification_loss(spec.module.apply), **extra)
    return Prepared(algorithm, spec, fed, (jnp.asarray(x_test), jnp.asarray(y_test)), client_test)


def _check_finite(infos, ckpt_dir: Path, last_good_round: int) -> None:
    client_ok = np.asarray(infos.clients.finite)
    server_ok = np.asarray(infos.server_finite)
    if client_ok.all() and server_ok.all():
        return
    bad_rounds = np.flatnonzero(~(client_ok.all(axis=1) & server_ok))
    r = int(bad_rounds[0])
    round_index = int(np.asarray(infos.round_index)[r])
    clients = np.asarray(infos.client_ids)[r][~client_ok[r]].tolist()
    where = f"client(s) {clients}" if clients else "the server update"
    raise NonFiniteError(
        f"non-finite loss or parameters first appeared in round {round_index}, in {where}. "
        f"The last good state (round {last_good_round}) is checkpointed in {ckpt_dir}. Lower the learning "
        f"rate or check the data, and start the run again with --overwrite (or another --output): --resume "
        f"would repeat the same rounds with the same configuration and keys, and meet the same NaN."
    )


def stream_problems(infos) -> tuple[int, str] | None:
    """The first round of a chunk in which a stream was invalid, and what was wrong, or ``None``: a client's
    coder reported an invalid input (``ClientInfo.valid``: an invalid ``q``/``p`` or a non-finite KL), the
    server's decoder found a malformed uplink stream (``RoundInfo.uplink_errors``, with the decoder's
    reasons), or a client could not decode its downlink (``ClientInfo.downlink_errors``). Returns
    ``(round_index, "client 3: ...; client 7: ...")``."""
    shape = np.shape(infos.client_ids)
    client_ok = np.asarray(infos.clients.valid).reshape(shape)
    errors = np.asarray(infos.uplink_errors).reshape(shape)
    down = np.broadcast_to(np.asarray(infos.clients.downlink_errors), shape)
    bad = ~client_ok | (errors != 0) | (down != 0)
    if not bad.any():
        return None
    r = int(np.flatnonzero(bad.any(axis=1))[0])
    ids = np.asarray(infos.client_ids)[r]
    details = []
    for i in np.flatnonzero(bad[r]):
        reasons = ["invalid q or p, or a non-finite KL"] if not client_ok[r, i] and not down[r, i] else []
        reasons += stream_errors(errors[r, i])
        reasons += [f"its downlink: {e}" for e in stream_errors(down[r, i])]
        details.append(f"client {int(ids[i])}: {', '.join(reasons)}")
    return int(np.asarray(infos.round_index)[r]), "; ".join(details)


def _check_streams(infos, ckpt_dir: Path, last_good_round: int) -> None:
    """Stops the run at the first round in which a stream was invalid (like NaN; see
    :func:`stream_problems`)."""
    problem = stream_problems(infos)
    if problem is None:
        return
    round_index, details = problem
    raise InvalidStreamError(
        f"an invalid stream in round {round_index} ({details}). Nothing from that round was kept: "
        f"the last good state (round {last_good_round}) is checkpointed in {ckpt_dir}. This is a bug or a "
        f"corrupted input, not a tuning problem: please report it."
    )


def broadcast_downlink_bpp(infos, own: dict[str, np.ndarray], num_params: int) -> np.ndarray:
    """Per round: what the downlink costs each participant on a broadcast channel (bits per parameter), for
    the ``broadcast_bpp`` column (uplink + this; the "bpp (BC)" of the BICompFL tables): the algorithm's own
    ``broadcast_downlink_bpp`` metric when it reports one (BICompFL-GR: all relayed streams sent once), else
    a shared downlink message's length divided by the participants who hear it
    (``RoundInfo.downlink_shared``), else the per-participant length (point-to-point messages)."""
    if "broadcast_downlink_bpp" in own:
        return np.asarray(own["broadcast_downlink_bpp"], np.float64)
    down = np.asarray(infos.downlink_bits, np.float64).reshape(np.shape(infos.client_ids))
    per_client = down.mean(axis=1) / num_params
    shared = np.broadcast_to(np.asarray(infos.downlink_shared, bool), per_client.shape)
    return np.where(shared, per_client / down.shape[1], per_client)


def algorithm_metrics(algorithm, infos, num_params: int) -> dict[str, np.ndarray]:
    """The algorithm's own metrics for a chunk of rounds (its ``metrics`` hook), one value per round; a
    ``name_bits`` metric becomes ``name_bpp`` (divided by the number of parameters)."""
    out = {}
    for name, values in algorithm.metrics(infos).items():
        values = np.asarray(values, np.float64).reshape(-1)
        if name.endswith("_bits"):
            name, values = name[: -len("_bits")] + "_bpp", values / num_params
        out[name] = values
    return out


def _warn_divergences(own: dict[str, np.ndarray], done: int, config: ExperimentConfig) -> None:
    """Reports, on stderr, every round in which a sampler's ``*_divergent`` metric (BPC-FL's HMC) counted
    divergent transitions: their proposals were rejected and the posterior samples are unreliable."""
    for name, values in own.items():
        if not name.endswith("_divergent"):
            continue
        for s, count in enumerate(np.asarray(values)):
            if np.isfinite(count) and count > 0:
                print(
                    f"warning: round {done + s + 1}: {int(count)} divergent transitions ({name}); the "
                    f"samples are unreliable: lower the step size (e.g. method.hmc_step_size, now "
                    f"{getattr(config.method, 'hmc_step_size', '?')}) or the inverse mass",
                    file=sys.stderr,
                )


def _metric_or_none(value: float) -> float | None:
    return None if not np.isfinite(value) else float(value)


def metric_columns(rows: list[dict[str, Any]]) -> list[str]:
    """:data:`METRIC_COLUMNS`, then the algorithm's own columns in the order they first appear."""
    extra = [k for r in rows for k in r if k not in METRIC_COLUMNS]
    return list(METRIC_COLUMNS) + list(dict.fromkeys(extra))


def _evaluator(eval_axis):
    """The evaluator builder for an algorithm's ``eval_axis`` (``None``: one model; ``"sample"``: the
    predictive average of an ensemble; ``"client"``: personal models)."""
    if eval_axis is None:
        return build_evaluator
    if eval_axis == "sample":
        return build_ensemble_evaluator
    raise ValueError(
        f"the experiment driver evaluates one model or a posterior ensemble on the common test set; an "
        f"algorithm with eval_axis={eval_axis!r} needs per-client test sets"
    )


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=metric_columns(rows))
        w.writeheader()
        for row in rows:
            w.writerow(row)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


PLOT_FILES = ("accuracy_vs_round.png", "accuracy_vs_bits.png", "accuracy_vs_uplink_bits.png")

_PLOTS = (  # (x column, file, title, x label, log x)
    ("round", "accuracy_vs_round.png", "Test accuracy by round", "round", False),
    (
        "cumulative_bits",
        "accuracy_vs_bits.png",
        "Test accuracy vs total bits (uplink + downlink)",
        "cumulative bits communicated, uplink + downlink (log scale)",
        True,
    ),
    (
        "cumulative_uplink_bits",
        "accuracy_vs_uplink_bits.png",
        "Test accuracy vs uplink bits (clients to server)",
        "cumulative uplink bits, all clients (log scale)",
        True,
    ),
)


def _with_uplink_cumsum(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``cumulative_uplink_bits`` (computed from ``uplink_bits`` for folders written before it)."""
    if all("cumulative_uplink_bits" in r for r in rows):
        return rows
    total, out = 0.0, []
    for r in rows:
        total += r["uplink_bits"]
        out.append({**r, "cumulative_uplink_bits": total})
    return out


def accuracy_figures(runs: dict[str, list[dict[str, Any]]], *, title: str | None = None) -> dict[str, Any]:
    """The accuracy plots of one or several labelled runs, as matplotlib figures keyed by file name.

    ``accuracy_vs_uplink_bits.png`` is the one that shows what compression buys: the total-bits plot is
    dominated by the 32-bit downlink broadcast, which every method here pays alike. Rounds are integer ticks;
    the legend sits below the axes, so it never covers a curve. ``title`` (e.g. the dataset and model) is
    added under each plot's title.
    """
    # matplotlib.figure.Figure, not pyplot: no global backend switch (a notebook's inline plots keep working
    # after a run), no figure manager to close; Jupyter displays a Figure like a pyplot one
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figures = {}
    for xkey, fname, heading, xlabel, logx in _PLOTS:
        fig = Figure(figsize=(6.4, 4.2), dpi=120)
        ax = fig.subplots()
        for label, rows in runs.items():
            rows = _with_uplink_cumsum(rows)
            pts = [(r[xkey], r["test_accuracy"]) for r in rows if r.get("test_accuracy") is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, [100 * v for v in ys], marker="o", ms=3, label=label)
        ax.set_title(f"{heading}\n{title}" if title else heading, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        if logx:
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(
                fontsize=8,
                loc="upper center",
                bbox_to_anchor=(0.5, -0.16),
                ncol=min(2, len(runs)),
                frameon=False,
            )
        figures[fname] = fig
    return figures


def plot_runs(
    runs: dict[str, list[dict[str, Any]]], out_dir: Path, *, title: str | None = None
) -> list[Path]:
    """Writes :func:`accuracy_figures` (the files :data:`PLOT_FILES`) to ``out_dir``; returns their paths."""
    paths = []
    for fname, fig in accuracy_figures(runs, title=title).items():
        path = Path(out_dir) / fname
        fig.savefig(path, bbox_inches="tight")
        paths.append(path)
    return paths


def _checkpoint_meta(
    round_index: int, rows: list[dict[str, Any]], wall_time_s: float, rounds_target: int
) -> dict[str, Any]:
    """The checkpoint's metadata: it carries the metrics rows of every round up to ``round_index``, so the
    state and the metrics (and with them the cumulative bits) are saved and restored as one unit."""
    return {
        "round_index": round_index,
        "wall_time_s": wall_time_s,
        "rows": rows,
        "rounds_target": rounds_target,
    }


def _checkpointed_rows(meta: dict[str, Any], state_round: int, ckpt_dir: Path) -> list[dict[str, Any]]:
    """The metrics rows stored with a checkpoint, checked against the state's round index."""
    rows = meta.get("rows")
    if (
        int(meta.get("round_index", -1)) != state_round
        or not isinstance(rows, list)
        or [r.get("round") for r in rows] != list(range(1, state_round + 1))
    ):
        raise CheckpointError(
            f"checkpoint in {ckpt_dir} is inconsistent: its state is at round {state_round} but its metadata "
            f"says round {meta.get('round_index')!r} with {len(rows) if isinstance(rows, list) else 'no'} "
            f"metrics rows; it cannot be resumed"
        )
    return rows


def _fmt_acc(acc: float | None) -> str:
    return f"{100 * acc:8.2f}%" if acc is not None else "        -"


def _fmt_row(row: dict[str, Any]) -> str:
    personal = f" | {_fmt_acc(row['personal_accuracy'])}" if "personal_accuracy" in row else ""
    return (
        f"{row['round']:>5d} | {_fmt_acc(row['test_accuracy'])}{personal} | {row['train_loss']:9.4f} | "
        f"{row['uplink_bpp']:9.3f} | {row['downlink_bpp']:9.3f} | {row['cumulative_bits']:12.4e}"
    )


TABLE_HEADER = "round |  test acc | trainloss | up bpp    | down bpp  | cum. bits"
PERSONAL_TABLE_HEADER = "round |  test acc | pers. acc | trainloss | up bpp    | down bpp  | cum. bits"


RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "metrics.csv",
    "summary.json",
    "resume_log.jsonl",
    *PLOT_FILES,
)
"""The files a run writes in its folder (besides ``checkpoint/``): what ``overwrite`` removes."""


#: the folder (a checksummed checkpoint file) holding a finished run's final model: the evaluated parameters,
#: or the first posterior sample of an ensemble (BPC-FL + SGD/Adam: the MAP estimate); what ``run.init_from``
#: of another run loads (BPC-FL as a FedAvg warm start, docs/papers/bpcfl.md#a6)
FINAL_PARAMS = "final_params"


def load_init_params(folder: str | Path, template):
    """The final model of the finished run in ``folder`` (``FINAL_PARAMS``), shaped like ``template``.

    Raises:
      FileNotFoundError: ``folder`` holds no finished run's final model.
      ValueError: the model does not match ``template`` (another architecture), or the file is damaged.
    """
    path = Path(folder) / FINAL_PARAMS
    if not checkpoint_exists(path):
        raise FileNotFoundError(
            f"run.init_from={str(folder)!r}: no {FINAL_PARAMS}/ there; it must be the results folder of a "
            f"finished run (every run writes its final model when it ends). A suite preset's bare name (e.g. "
            f"bpcfl_moons_bpcfl_sgd) is resolved by its table command to that preset's run folder; with "
            f"experiments.run, pass --run.init_from <that folder>"
        )
    try:
        params, meta = load_checkpoint(path, template)
    except CheckpointError as e:
        raise ValueError(
            f"run.init_from={str(folder)!r}: its final model cannot initialise this run ({e}); it must be a "
            f"run of the same data.model on the same data"
        ) from e
    return params, meta


class RunExistsError(FileExistsError):
    """The output folder already holds a run, and neither ``resume`` nor ``overwrite`` was asked for."""


def is_run_folder(output_dir: str | Path) -> bool:
    """Whether ``output_dir`` holds (part of) a run: a config, metrics or a checkpoint."""
    out = Path(output_dir)
    return (
        (out / "config.json").is_file()
        or (out / "metrics.jsonl").is_file()
        or checkpoint_exists(out / "checkpoint")
    )


def check_new_output(out: str | Path, *, overwrite: bool, flag: str = "--output") -> None:
    """The one rule for a folder a new run writes into: it must not exist, or be empty, unless
    ``overwrite``. Raises :class:`RunExistsError` naming what is there (and ``--resume`` when a run there
    can be continued); ``ValueError`` if ``out`` is a file. Reads only the folder's listing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder: choose a folder for the results")
    if overwrite or not out.exists():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if is_run_folder(out):
        resumable = (out / "config.json").is_file() and checkpoint_exists(out / "checkpoint")
        raise RunExistsError(
            f"{out} already holds a run (config.json, metrics or checkpoint/); "
            + ("pass --resume to continue it, " if resumable else "")
            + f"pass --overwrite to replace it, or choose another {flag}"
        )
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    raise RunExistsError(
        f"{out} is not empty ({shown}) and holds no run to continue: choose another {flag} (a new or empty "
        "folder), or pass --overwrite to write into it (files of the same names are replaced)"
    )


def _remove_run(out: Path) -> None:
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for folder in ("checkpoint", FINAL_PARAMS):
        if (out / folder).is_dir():
            shutil.rmtree(out / folder)


def check_resumable_folder(output_dir: str | Path) -> None:
    """Raises ``FileNotFoundError`` (saying what to do instead) unless ``output_dir`` holds a run with a
    ``config.json`` and a checkpoint. Reads nothing else and creates nothing."""
    out = Path(output_dir)
    if (out / "config.json").is_file() and checkpoint_exists(out / "checkpoint"):
        return
    if not out.exists():
        hint = "the folder does not exist; start the run without --resume"
    elif is_run_folder(out):
        hint = "a run was started there but has no config.json and checkpoint to continue from; start it "
        hint += "again with --overwrite"
    else:
        hint = "the folder has no config.json and checkpoint/; start the run without --resume"
    raise FileNotFoundError(f"--resume: no run to resume in {out} ({hint})")


def same_run_config(output_dir: str | Path, config: ExperimentConfig) -> ExperimentConfig:
    """Checks, before any work, that ``output_dir`` holds a run of ``config`` (every field but
    ``run.rounds`` and the launch settings) with a checkpoint; used by ``--resume`` and by the suites.
    Returns the saved config (with ``config``'s rounds and launch settings).

    Raises:
      ValueError: naming the fields that differ (or the topology to resume on).
      FileNotFoundError: no run with a checkpoint there.
    """
    out = Path(output_dir)
    check_resumable_folder(out)
    saved = run_config(json.loads((out / "config.json").read_text()), source=str(out / "config.json"))
    launch = {k: config.flat()[k] for k in distributed.LAUNCH_FIELDS}
    if saved.override({"run.rounds": config.run.rounds, **launch}) != config:
        now, then = config.flat(), saved.flat()
        ignore = ("run.rounds", *distributed.LAUNCH_FIELDS)
        diff = {k: (v, then.get(k)) for k, v in now.items() if k not in ignore and then.get(k) != v}
        diff.update({k: (None, v) for k, v in then.items() if k not in now})
        if set(diff) <= {"run.devices", "run.processes"}:
            raise ValueError(
                f"--resume: the run in {out} was checkpointed on {saved.run.devices} device(s) in "
                f"{saved.run.processes} process(es), and this run asks for {config.run.devices} in "
                f"{config.run.processes}: resume it on the same topology (--run.devices "
                f"{saved.run.devices} --run.processes {saved.run.processes}); a run's rounds are bit-exact "
                "only on the topology that started them"
            )
        raise ValueError(f"--resume: config differs from the checkpointed run in {out} (now, saved): {diff}")
    return saved.override({"run.rounds": config.run.rounds, **launch})


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
      RunExistsError: ``output_dir`` holds a run and neither ``resume`` nor ``overwrite`` is set.
      FileNotFoundError: ``resume`` without a run to resume in ``output_dir``.
      CheckpointError: ``resume`` from a damaged or inconsistent checkpoint.
      ValueError: bad configuration, or ``resume`` with a different configuration.
    """
    from tqdm.auto import tqdm

    out = Path(output_dir)
    ckpt_dir = out / "checkpoint"
    distributed.start(config.run)  # several processes: join them (before JAX starts its backend)
    writer = distributed.is_writer()  # only process 0 writes the folder
    if resume and overwrite:
        raise ValueError(
            "resume and overwrite exclude each other: resume continues the run in the folder, "
            "overwrite replaces it"
        )
    if resume:
        same_run_config(out, config)
    else:
        check_new_output(out, overwrite=overwrite)
    # several processes: the same configuration everywhere, and a barrier (every process has checked the
    # folder before process 0 writes to it)
    distributed.check_same_config(config)
    t_start = time.perf_counter()

    algorithm, spec, fed, (x_test, y_test), client_test = prepare(config)
    personal = algorithm.personal_params is not None
    if personal and client_test is None:
        raise ValueError(
            f"{config.algorithm} is a personalized method: its personal models are evaluated on each "
            f"client's own test set, which data.partition={config.data.partition!r} does not give; use "
            f'data.partition = "pfedme" (with data.labels_per_client, data.examples_per_label and '
            f"data.train_fraction)"
        )
    rounds = config.run.rounds
    init_key, rounds_key = run_keys(config.run.seed)
    params = init_params(init_key, spec)
    if config.run.init_from:  # e.g. BPC-FL's MAP estimate as FedAvg's start (docs/papers/bpcfl.md#a6)
        params, _ = load_init_params(config.run.init_from, params)
    num_params = count_params(params)
    state = algorithm.init(init_key, params, int(fed.num_examples.shape[0]))
    rows: list[dict[str, Any]] = []
    # Trace one round (shapes only, nothing compiled or run) before anything is written: a configuration the
    # algorithm refuses at trace time (e.g. a coreset larger than a client's data) fails here, not after the
    # run folder exists.
    cmap = client_map(config)
    jax.eval_shape(build_round_step(algorithm, client_map=cmap), round_key(rounds_key, 0), state, fed)

    if resume:
        state, meta = load_checkpoint(ckpt_dir, state)
        rows = _checkpointed_rows(meta, int(state.round_index), ckpt_dir)
        if rounds < len(rows):
            raise ValueError(
                f"--resume: run.rounds={rounds} is below the {len(rows)} rounds already done in {out}; "
                f"a run cannot be shortened (its metrics up to any round are in metrics.jsonl)"
            )
        t_start -= float(meta.get("wall_time_s", 0.0))
        if writer:
            with (out / "resume_log.jsonl").open("a") as f:
                entry = {"time": datetime.now(UTC).isoformat(timespec="seconds"), "from_round": len(rows)}
                f.write(json.dumps({**entry, "rounds": rounds}) + "\n")
    elif writer:
        if overwrite:
            _remove_run(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(
            json.dumps(
                {
                    "algorithm": config.algorithm,
                    **config.to_dict(),
                    "clients_per_round": config.clients_per_round,
                    "num_params": num_params,
                },
                indent=2,
            )
        )
        save_checkpoint(ckpt_dir, state, _checkpoint_meta(0, [], 0.0, rounds))
    # metrics.jsonl is a log for watching a run; the checkpoint holds the authoritative rows, so on resume
    # the file is rewritten from them (rows written after the checkpointed round are dropped, none are lost)
    if writer:
        with (out / "metrics.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    # a mesh: the examples and the client state go to the devices that hold them (each process places its
    # own devices' shares); host_view(state) gives the whole state back for evaluation and checkpoints
    state, fed = place_federation(cmap, state, fed)
    host_view = gather_to_host if config.run.processes > 1 else (lambda tree: tree)

    evaluate = jax.jit(
        _evaluator(algorithm.eval_axis)(spec.module.apply, batch_size=config.run.eval_batch_size)
    )
    if personal:
        evaluate_personal = jax.jit(
            build_personal_evaluator(spec.module.apply, batch_size=config.run.eval_batch_size)
        )
    cum_bits = rows[-1]["cumulative_bits"] if rows else 0.0
    cum_up = rows[-1]["cumulative_uplink_bits"] if rows else 0.0
    done = int(state.round_index)
    progress, verbose = progress and writer, verbose and writer
    if verbose:
        print(
            f"{config.algorithm} on {config.data.dataset}/{config.data.model}: {num_params:,} parameters, "
            f"{config.data.num_clients} clients ({config.clients_per_round} per round), output {out}"
        )
        print(PERSONAL_TABLE_HEADER if personal else TABLE_HEADER)

    # several processes: a collective that fails (another process died) stops this one with a clear error
    def lost():
        return distributed.lost_process_error(
            config.run,
            lambda: (
                f"the last checkpoint in {out} is at round {done}; start every process again with --resume "
                f"(the same --run.processes and --run.devices) to continue"
            ),
        )

    with lost():
        bar = tqdm(total=rounds, initial=done, disable=not progress, unit="round", leave=False)
        stopped_early = False
        stop_at = config.run.stop_at_accuracy
        while done < rounds and not stopped_early:
            chunk = min(config.run.eval_every, rounds - done)
            new_state, infos = run_rounds(algorithm, rounds_key, state, fed, chunk, client_map=cmap)
            # Checks of the chunk's flags, before its state is accepted or checkpointed (the last good state
            # stays on disk): NaN/inf, then the coders' input flags and the server's stream errors.
            _check_finite(infos, ckpt_dir, done)
            _check_streams(infos, ckpt_dir, done)
            state = new_state
            view = host_view(state)
            ev = evaluate(algorithm.eval_params(view), x_test, y_test)
            acc, tloss, tece = float(ev.accuracy), float(ev.loss), float(ev.ece)
            personal_ev = {}
            if personal:
                pev = client_mean(
                    evaluate_personal(
                        algorithm.personal_params(view), client_test.x, client_test.y, client_test.mask
                    )
                )
                personal_ev = dict(zip(PERSONAL_COLUMNS, (float(pev.accuracy), float(pev.loss)), strict=True))
            up = np.asarray(infos.uplink_bits, np.float64)
            down = np.asarray(infos.downlink_bits, np.float64)
            train_loss = np.asarray(infos.clients.loss, np.float64).mean(axis=1)
            own = algorithm_metrics(algorithm, infos, num_params)
            _warn_divergences(own, done, config)
            bc_down = broadcast_downlink_bpp(infos, own, num_params)
            new_rows = []
            for s in range(chunk):
                cum_bits += up[s].sum() + down[s].sum()
                cum_up += up[s].sum()
                last = s == chunk - 1
                new_rows.append(
                    {
                        "round": done + s + 1,
                        "test_accuracy": acc if last else None,
                        "test_loss": tloss if last else None,
                        "test_ece": tece if last else None,
                        "train_loss": float(train_loss[s]),
                        "uplink_bpp": float(up[s].mean() / num_params),
                        "downlink_bpp": float(down[s].mean() / num_params),
                        "broadcast_bpp": float(up[s].mean() / num_params + bc_down[s]),
                        "uplink_bits": float(up[s].sum()),
                        "downlink_bits": float(down[s].sum()),
                        "cumulative_bits": float(cum_bits),
                        "cumulative_uplink_bits": float(cum_up),
                        "wall_time_s": round(time.perf_counter() - t_start, 3),
                        **{name: value if last else None for name, value in personal_ev.items()},
                        **{name: _metric_or_none(values[s]) for name, values in own.items()},
                    }
                )
            rows.extend(new_rows)
            done += chunk
            if writer:
                with (out / "metrics.jsonl").open("a") as f:
                    for r in new_rows:
                        f.write(json.dumps(r) + "\n")
                meta = _checkpoint_meta(done, rows, time.perf_counter() - t_start, rounds)
                save_checkpoint(ckpt_dir, view, meta)
                _write_csv(out / "metrics.csv", rows)
            if verbose:
                for r in new_rows:
                    bar.write(_fmt_row(r))
            bar.update(chunk)
            if stop_at is not None and acc >= stop_at:
                stopped_early = True
                if verbose:
                    bar.write(f"reached run.stop_at_accuracy={stop_at} at round {done}")
        bar.close()
    if algorithm.eval_axis in (None, "sample"):
        with lost():
            final = algorithm.eval_params(host_view(state))  # (every process: a collective on several)
        if algorithm.eval_axis == "sample":
            final = jax.tree.map(lambda a: a[0], final)
    if algorithm.eval_axis in (None, "sample") and writer:
        # (also written by a resume of a finished run, so an interrupt while writing it loses nothing)
        checkpoint.save_checkpoint(
            out / FINAL_PARAMS,
            final,
            {"algorithm": config.algorithm, "round": done, "sample": 0 if algorithm.eval_axis else None},
        )

    accs = [r["test_accuracy"] for r in rows if r["test_accuracy"] is not None]
    personal_accs = [r["personal_accuracy"] for r in rows if r.get("personal_accuracy") is not None]
    summary = RunSummary(
        output_dir=out,
        rounds_run=done,
        final_accuracy=accs[-1] if accs else math.nan,
        best_accuracy=max(accs) if accs else math.nan,
        tail_accuracy=tail_accuracy(accs) if accs else math.nan,
        total_bits=cum_bits,
        mean_uplink_bpp=float(np.mean([r["uplink_bpp"] for r in rows])) if rows else math.nan,
        mean_downlink_bpp=float(np.mean([r["downlink_bpp"] for r in rows])) if rows else math.nan,
        mean_broadcast_bpp=_mean_or_none([r.get("broadcast_bpp") for r in rows]),
        metrics=rows,
    )
    personal_summary = {}
    if personal:
        summary.final_personal_accuracy = personal_accs[-1] if personal_accs else math.nan
        summary.best_personal_accuracy = max(personal_accs) if personal_accs else math.nan
        summary.tail_personal_accuracy = tail_accuracy(personal_accs) if personal_accs else math.nan
        personal_summary = {
            "final_personal_accuracy": summary.final_personal_accuracy,
            "best_personal_accuracy": summary.best_personal_accuracy,
            "tail_personal_accuracy": summary.tail_personal_accuracy,
        }
    if not writer:
        return summary
    plot_runs(
        {label or config.algorithm: rows},
        out,
        title=f"{config.data.dataset} / {config.data.model}, {config.data.num_clients} clients "
        f"({config.data.partition})",
    )
    (out / "summary.json").write_text(
        json.dumps(
            {
                "rounds_run": done,
                "rounds_target": rounds,
                "final_accuracy": summary.final_accuracy,
                "best_accuracy": summary.best_accuracy,
                "tail_accuracy": summary.tail_accuracy,
                "tail_evals": min(TAIL_EVALS, len(accs)),
                **personal_summary,
                "total_bits": summary.total_bits,
                "mean_uplink_bpp": summary.mean_uplink_bpp if rows else None,
                "mean_downlink_bpp": summary.mean_downlink_bpp if rows else None,
                "mean_broadcast_bpp": summary.mean_broadcast_bpp,
                **{
                    f"mean_{c}": _mean_or_none([r.get(c) for r in rows])
                    for c in metric_columns(rows)[len(METRIC_COLUMNS) :]
                    if c.endswith("_bpp")
                },
                "num_params": num_params,
                "wall_time_s": round(time.perf_counter() - t_start, 2),
                "backend": jax.default_backend(),
                **distributed.topology(),
            },
            indent=2,
        )
    )
    return summary
