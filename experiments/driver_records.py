"""The records of a run: its metrics rows (one per round), its checkpoints (the state with the rows up to it),
its final model, ``summary.json``, ``metrics.jsonl``/``metrics.csv`` and the console table; the files'
layout is in :mod:`experiments.driver`.

Bits in the metrics are the lengths of the messages the algorithm built (``RoundInfo``), summed over the
participants; ``*_bpp`` columns are bits per parameter per participating client.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from experiments import checkpoint, distributed
from experiments.checkpoint import (
    CheckpointError,
    checkpoint_exists,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from experiments.config import ExperimentConfig
from experiments.driver_folder import FINAL_PARAMS, log_resume, remove_run, write_config
from experiments.driver_plots import plot_runs
from experiments.interrupts import writing
from sidejax.coding import STREAM_FORMAT, check_stream_format

__all__ = [
    "METRIC_COLUMNS",
    "TEST_COLUMNS",
    "PERSONAL_COLUMNS",
    "TAIL_EVALS",
    "TABLE_HEADER",
    "PERSONAL_TABLE_HEADER",
    "RunSummary",
    "Records",
    "tail_accuracy",
    "metric_columns",
    "broadcast_downlink_bpp",
    "algorithm_metrics",
    "read_jsonl",
    "format_row",
    "load_init_params",
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


#: the columns a personalized method (``algorithm.evaluation.personal``) logs besides :data:`METRIC_COLUMNS`:
#: the personal models, each on its client's test set, pooled over the clients (``None`` in rounds that
#: are not evaluated)
PERSONAL_COLUMNS = ("personal_accuracy", "personal_loss")

#: the columns of the global model's evaluation on the test set (``None`` in rounds that are not evaluated)
TEST_COLUMNS = ("test_accuracy", "test_loss", "test_ece")


TAIL_EVALS = 5
"""``tail_accuracy`` is the mean test accuracy of the last this-many evaluations: methods that evaluate a
sampled network (FedPM's ``m ~ Bern(theta)``) move by several points from one evaluation to the next, so a
single final number is a poor basis for comparing two runs."""


def tail_accuracy(accuracies: list[float]) -> float | None:
    """Mean of the last :data:`TAIL_EVALS` test accuracies (``None`` if there are none)."""
    tail = accuracies[-TAIL_EVALS:]
    return float(np.mean(tail)) if tail else None


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


def metric_columns(rows: list[dict[str, Any]]) -> list[str]:
    """:data:`METRIC_COLUMNS`, then the algorithm's own columns in the order they first appear."""
    extra = [k for r in rows for k in r if k not in METRIC_COLUMNS]
    return list(METRIC_COLUMNS) + list(dict.fromkeys(extra))


def _metric_or_none(value: float) -> float | None:
    return None if not np.isfinite(value) else float(value)


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


def _checkpoint_meta(
    round_index: int, rows: list[dict[str, Any]], wall_time_s: float, rounds_target: int, **partial: int
) -> dict[str, Any]:
    """The checkpoint's metadata: it carries the metrics rows of every round up to ``round_index``, so the
    state and the metrics (and with them the cumulative bits) are saved and restored as one unit. A
    checkpoint inside round ``round_index + 1`` (``run.clients_per_step``) also says how many of its
    participants have run (``clients_done`` of ``round_clients``). ``stream_format`` is the candidate
    generator's version (:data:`sidejax.coding.STREAM_FORMAT`): a run resumed under another one would
    continue with other candidates, so :meth:`Records.open` refuses it."""
    return {
        "stream_format": STREAM_FORMAT,
        "round_index": round_index,
        "wall_time_s": wall_time_s,
        "rows": rows,
        "rounds_target": rounds_target,
        **partial,
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


def _fmt_acc(acc: float | None) -> str:
    return f"{100 * acc:8.2f}%" if acc is not None else "        -"


def format_row(row: dict[str, Any]) -> str:
    personal = f" | {_fmt_acc(row['personal_accuracy'])}" if "personal_accuracy" in row else ""
    return (
        f"{row['round']:>5d} | {_fmt_acc(row['test_accuracy'])}{personal} | {row['train_loss']:9.4f} | "
        f"{row['uplink_bpp']:9.3f} | {row['downlink_bpp']:9.3f} | {row['cumulative_bits']:12.4e}"
    )


TABLE_HEADER = "round |  test acc | trainloss | up bpp    | down bpp  | cum. bits"


PERSONAL_TABLE_HEADER = "round |  test acc | pers. acc | trainloss | up bpp    | down bpp  | cum. bits"


def _summary(out: Path, rows: list[dict[str, Any]], *, personal: bool) -> RunSummary:
    """The :class:`RunSummary` of the metrics rows of a run in ``out`` (the personal accuracies if
    ``personal``)."""
    accs = [r["test_accuracy"] for r in rows if r["test_accuracy"] is not None]
    summary = RunSummary(
        output_dir=out,
        rounds_run=len(rows),
        final_accuracy=accs[-1] if accs else math.nan,
        best_accuracy=max(accs) if accs else math.nan,
        tail_accuracy=tail_accuracy(accs) if accs else math.nan,
        total_bits=rows[-1]["cumulative_bits"] if rows else 0.0,
        mean_uplink_bpp=float(np.mean([r["uplink_bpp"] for r in rows])) if rows else math.nan,
        mean_downlink_bpp=float(np.mean([r["downlink_bpp"] for r in rows])) if rows else math.nan,
        mean_broadcast_bpp=_mean_or_none([r.get("broadcast_bpp") for r in rows]),
        metrics=rows,
    )
    if personal:
        personal_accs = [r["personal_accuracy"] for r in rows if r.get("personal_accuracy") is not None]
        summary.final_personal_accuracy = personal_accs[-1] if personal_accs else math.nan
        summary.best_personal_accuracy = max(personal_accs) if personal_accs else math.nan
        summary.tail_personal_accuracy = tail_accuracy(personal_accs) if personal_accs else math.nan
    return summary


class Records:
    """The records of one run in its folder ``out``: the metrics rows (:attr:`rows`, one per round done;
    every checkpoint carries them, the authoritative copy) and, in the process that writes the folder
    (``writer``), ``config.json``, ``metrics.jsonl`` (appended as rounds finish), ``metrics.csv``, the
    checkpoint, the final model, ``summary.json`` and the plots.

    ``t_start`` is the run's ``time.perf_counter()`` start (moved back by the wall time already spent, on a
    resume): the ``wall_time_s`` of the rows, checkpoints and summary count from it.
    """

    def __init__(
        self, out: Path, config: ExperimentConfig, num_params: int, *, writer: bool, t_start: float
    ) -> None:
        self.out, self.config, self.num_params, self.writer = out, config, num_params, writer
        self.ckpt_dir = out / "checkpoint"
        self.t_start = t_start
        self.rows: list[dict[str, Any]] = []
        #: the round in parts a resume continues (:meth:`open`), else ``None``
        self.partial = None

    @property
    def done(self) -> int:
        """The rounds done (recorded)."""
        return len(self.rows)

    def open(self, state, *, resume: bool, overwrite: bool, partial_like=None):
        """Starts the records; returns the state to run from. ``resume``: the checkpointed state and rows
        (the target ``run.rounds`` must not be below the rounds done), a line in ``resume_log.jsonl``; else
        the folder (emptied of a run first if ``overwrite``), ``config.json`` and the round-0 checkpoint of
        ``state``. ``metrics.jsonl`` is a log for watching a run; the checkpoint holds the authoritative
        rows, so on resume the file is rewritten from them (rows written after the checkpointed round are
        dropped, none are lost). A checkpoint inside a round (:meth:`record_part`) also restores the round's
        :class:`sidejax.fl.PartialRound` into :attr:`partial`, shaped like ``partial_like()``."""
        rounds = self.config.run.rounds
        self.partial = None
        if resume:
            saved_meta = read_checkpoint_meta(self.ckpt_dir)
            try:  # checkpoints before the counter hash carry no stream format: they are format 1
                check_stream_format(saved_meta.get("stream_format", 1), f"the checkpoint in {self.ckpt_dir}")
            except ValueError as e:
                raise CheckpointError(
                    f"{e}; --resume cannot continue it: start the run again (--overwrite)"
                ) from None
            if "clients_done" in saved_meta:
                if partial_like is None:
                    raise CheckpointError(
                        f"checkpoint in {self.ckpt_dir} is inside a round, and this run does not run rounds "
                        f"in parts (run.clients_per_step)"
                    )
                (state, self.partial), meta = load_checkpoint(self.ckpt_dir, (state, partial_like()))
            else:
                state, meta = load_checkpoint(self.ckpt_dir, state)
            self.rows = _checkpointed_rows(meta, int(state.round_index), self.ckpt_dir)
            if rounds < self.done:
                raise ValueError(
                    f"--resume: run.rounds={rounds} is below the {self.done} rounds already done in "
                    f"{self.out}; a run cannot be shortened (its metrics up to any round are in "
                    "metrics.jsonl)"
                )
            self.t_start -= float(meta.get("wall_time_s", 0.0))
            if self.writer:
                with writing():
                    log_resume(self.out, self.done, rounds)
        elif self.writer:
            with writing():
                if overwrite:
                    remove_run(self.out)
                write_config(self.out, self.config, self.num_params)
                save_checkpoint(self.ckpt_dir, state, _checkpoint_meta(0, [], 0.0, rounds))
        if self.writer:
            with writing(), (self.out / "metrics.jsonl").open("w") as f:
                for r in self.rows:
                    f.write(json.dumps(r) + "\n")
        return state

    def record(self, view, infos, own: dict[str, np.ndarray], scores: dict[str, float]) -> list[dict]:
        """Records a chunk of rounds: their rows (from the chunk's round-stacked ``infos``, the algorithm's
        own metrics ``own`` and the evaluation ``scores`` after its last round) are added to :attr:`rows`
        and, by the writer, to ``metrics.jsonl`` and ``metrics.csv``, and the state ``view`` (on the host)
        is checkpointed with them. Returns the new rows."""
        new_rows = self._chunk_rows(infos, own, scores)
        self.rows.extend(new_rows)
        if self.writer:
            with writing():
                with (self.out / "metrics.jsonl").open("a") as f:
                    for r in new_rows:
                        f.write(json.dumps(r) + "\n")
                meta = _checkpoint_meta(
                    self.done, self.rows, time.perf_counter() - self.t_start, self._target
                )
                save_checkpoint(self.ckpt_dir, view, meta)
                _write_csv(self.out / "metrics.csv", self.rows)
        return new_rows

    def record_part(self, view, partial_view) -> None:
        """Checkpoints a round in parts (``run.clients_per_step``) after a part: the state ``view`` of the
        rounds done, with the round's :class:`sidejax.fl.PartialRound` ``partial_view`` (both on the host),
        so that a resume runs only the participants not yet run."""
        if self.writer:
            done, total = int(partial_view.clients_done), int(np.shape(partial_view.phase.client_ids)[0])
            meta = _checkpoint_meta(
                self.done,
                self.rows,
                time.perf_counter() - self.t_start,
                self._target,
                clients_done=done,
                round_clients=total,
            )
            with writing():
                save_checkpoint(self.ckpt_dir, (view, partial_view), meta)

    @property
    def _target(self) -> int:
        return self.config.run.rounds

    def _chunk_rows(self, infos, own: dict[str, np.ndarray], scores: dict[str, float]) -> list[dict]:
        """One row per round of the chunk: :data:`METRIC_COLUMNS` (the scores in its last round only), the
        evaluation's other columns (the personal ones), then the algorithm's own metrics."""
        up = np.asarray(infos.uplink_bits, np.float64)
        down = np.asarray(infos.downlink_bits, np.float64)
        train_loss = np.asarray(infos.clients.loss, np.float64).mean(axis=1)
        bc_down = broadcast_downlink_bpp(infos, own, self.num_params)
        cum_bits = self.rows[-1]["cumulative_bits"] if self.rows else 0.0
        cum_up = self.rows[-1]["cumulative_uplink_bits"] if self.rows else 0.0
        n, chunk = self.num_params, up.shape[0]
        new_rows = []
        for s in range(chunk):
            cum_bits += up[s].sum() + down[s].sum()
            cum_up += up[s].sum()
            last = s == chunk - 1
            new_rows.append(
                {
                    "round": self.done + s + 1,
                    **{c: scores[c] if last else None for c in TEST_COLUMNS},
                    "train_loss": float(train_loss[s]),
                    "uplink_bpp": float(up[s].mean() / n),
                    "downlink_bpp": float(down[s].mean() / n),
                    "broadcast_bpp": float(up[s].mean() / n + bc_down[s]),
                    "uplink_bits": float(up[s].sum()),
                    "downlink_bits": float(down[s].sum()),
                    "cumulative_bits": float(cum_bits),
                    "cumulative_uplink_bits": float(cum_up),
                    "wall_time_s": round(time.perf_counter() - self.t_start, 3),
                    **{c: v if last else None for c, v in scores.items() if c not in TEST_COLUMNS},
                    **{name: _metric_or_none(values[s]) for name, values in own.items()},
                }
            )
        return new_rows

    def save_final(self, params, sample: int | None) -> None:
        """Writes the final model (:data:`FINAL_PARAMS`; also on a resume of a finished run, so an interrupt
        while writing it loses nothing); ``sample``: which posterior sample of an ensemble it is."""
        if self.writer:
            with writing():
                checkpoint.save_checkpoint(
                    self.out / FINAL_PARAMS,
                    params,
                    {"algorithm": self.config.algorithm, "round": self.done, "sample": sample},
                )

    def finish(self, *, personal: bool, label: str | None) -> RunSummary:
        """The run's :class:`RunSummary`; the writer also writes the plots (the run named ``label``, default
        the algorithm) and ``summary.json``."""
        summary = _summary(self.out, self.rows, personal=personal)
        if self.writer:
            data = self.config.data
            with writing():
                plot_runs(
                    {label or self.config.algorithm: self.rows},
                    self.out,
                    title=f"{data.dataset} / {data.model}, {data.num_clients} clients ({data.partition})",
                )
                (self.out / "summary.json").write_text(json.dumps(self._summary_json(summary), indent=2))
        return summary

    def _summary_json(self, summary: RunSummary) -> dict[str, Any]:
        rows = self.rows
        personal = {}
        if summary.final_personal_accuracy is not None:
            personal = {
                "final_personal_accuracy": summary.final_personal_accuracy,
                "best_personal_accuracy": summary.best_personal_accuracy,
                "tail_personal_accuracy": summary.tail_personal_accuracy,
            }
        return {
            "rounds_run": summary.rounds_run,
            "rounds_target": self._target,
            "final_accuracy": summary.final_accuracy,
            "best_accuracy": summary.best_accuracy,
            "tail_accuracy": summary.tail_accuracy,
            "tail_evals": min(TAIL_EVALS, sum(r["test_accuracy"] is not None for r in rows)),
            **personal,
            "total_bits": summary.total_bits,
            "mean_uplink_bpp": summary.mean_uplink_bpp if rows else None,
            "mean_downlink_bpp": summary.mean_downlink_bpp if rows else None,
            "mean_broadcast_bpp": summary.mean_broadcast_bpp,
            **{
                f"mean_{c}": _mean_or_none([r.get(c) for r in rows])
                for c in metric_columns(rows)[len(METRIC_COLUMNS) :]
                if c.endswith("_bpp")
            },
            "num_params": self.num_params,
            "wall_time_s": round(time.perf_counter() - self.t_start, 2),
            "backend": jax.default_backend(),
            **distributed.topology(),
        }
