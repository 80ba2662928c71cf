"""The round loop of a run: its initial state, chunks of ``run.eval_every`` jitted rounds
(:func:`sidejax.fl.run_rounds`), the checks of each chunk's flags before its state is accepted (NaN/inf,
invalid streams), its evaluation and its records, until ``run.rounds`` (or ``run.stop_at_accuracy``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from experiments import distributed, interrupts
from experiments.algorithms import client_map
from experiments.config import ExperimentConfig
from experiments.driver_eval import Evaluator
from experiments.driver_records import (
    PERSONAL_TABLE_HEADER,
    TABLE_HEADER,
    Records,
    algorithm_metrics,
    format_row,
    load_init_params,
)
from sidejax.coding import stream_errors
from sidejax.fl import build_round_step, finish_round, gather_to_host, run_clients, run_rounds, start_round
from sidejax.keys import round_key, run_keys
from sidejax.models import count_params, init_params

__all__ = [
    "NonFiniteError",
    "InvalidStreamError",
    "Rounds",
    "stream_problems",
    "start_rounds",
    "host_view",
    "lost_process",
    "run_chunks",
]


class NonFiniteError(FloatingPointError):
    """Raised when a loss or a parameter becomes NaN/inf; names the first round and clients affected."""


class InvalidStreamError(RuntimeError):
    """Raised when the server found a client's KLMS stream malformed; names the first round and clients."""


class _Flags(NamedTuple):
    """A chunk's per-participant flags, each ``[rounds, clients_per_round]``: the coder's input check
    (``valid``), ``finite``, the server's decoder errors (``errors``), the client's downlink errors
    (``down``), whether the server counted it (``included``, ``RoundInfo.included``; diagnostics built without
    it count the clients whose flags are all good) and whether it is flagged at all (``bad``)."""

    valid: np.ndarray
    finite: np.ndarray
    errors: np.ndarray
    down: np.ndarray
    included: np.ndarray
    bad: np.ndarray


def _flags(infos) -> _Flags:
    shape = np.shape(infos.client_ids)
    valid = np.asarray(infos.clients.valid).reshape(shape)
    finite = np.asarray(infos.clients.finite).reshape(shape)
    errors = np.asarray(infos.uplink_errors).reshape(shape)
    down = np.broadcast_to(np.asarray(infos.clients.downlink_errors), shape)
    included = getattr(infos, "included", None)
    included = valid & finite & (errors == 0) if included is None else np.asarray(included).reshape(shape)
    bad = ~valid | (errors != 0) | (down != 0) | ~included
    return _Flags(valid, finite, errors, down, included, bad)


def _check_finite(infos, ckpt_dir: Path, last_good_round: int) -> None:
    """Stops the run at the first round whose server state is not finite or in which every participant was
    non-finite (no client left to aggregate). A round in which only some clients were non-finite goes on:
    the engine withheld their streams and the server aggregated the others (:func:`_check_streams` says
    which)."""
    client_ok = np.asarray(infos.clients.finite)
    server_ok = np.asarray(infos.server_finite)
    stop = ~server_ok | ~client_ok.any(axis=1)
    if not stop.any():
        return
    r = int(np.flatnonzero(stop)[0])
    round_index = int(np.asarray(infos.round_index)[r])
    clients = np.asarray(infos.client_ids)[r][~client_ok[r]].tolist()
    where = f"client(s) {clients}" if clients else "the server update"
    raise NonFiniteError(
        f"non-finite loss or parameters first appeared in round {round_index}, in {where}. "
        f"The last good state (round {last_good_round}) is checkpointed in {ckpt_dir}. Lower the learning "
        f"rate or check the data, and start the run again with --overwrite (or another --output): --resume "
        f"would repeat the same rounds with the same configuration and keys, and meet the same NaN."
    )


def _problems(infos, flags: _Flags, r: int) -> str:
    """``"client 3: ...; client 7: ..."``: round ``r``'s flagged participants and why."""
    ids = np.asarray(infos.client_ids)[r]
    details = []
    for i in np.flatnonzero(flags.bad[r]):
        valid, finite, down = flags.valid[r, i], flags.finite[r, i], flags.down[r, i]
        reasons = ["invalid q or p, or a non-finite KL"] if not valid and not down else []
        reasons += [] if finite else ["a non-finite loss or update"]
        if valid and finite:  # a withheld stream's decoder errors say only that it is absent
            reasons += stream_errors(flags.errors[r, i])
        reasons += [f"its downlink: {e}" for e in stream_errors(down)]
        details.append(f"client {int(ids[i])}: {', '.join(reasons) or 'excluded by the server'}")
    return "; ".join(details)


def stream_problems(infos) -> tuple[int, str] | None:
    """The first round of a chunk in which a stream was invalid, and what was wrong, or ``None``: a client's
    coder reported an invalid input (``ClientInfo.valid``: an invalid ``q``/``p`` or a non-finite KL), the
    server's decoder found a malformed uplink stream (``RoundInfo.uplink_errors``, with the decoder's
    reasons), a client could not decode its downlink (``ClientInfo.downlink_errors``), or the server left a
    participant out of its aggregates (``RoundInfo.included``). Returns
    ``(round_index, "client 3: ...; client 7: ...")``."""
    flags = _flags(infos)
    if not flags.bad.any():
        return None
    r = int(np.flatnonzero(flags.bad.any(axis=1))[0])
    return int(np.asarray(infos.round_index)[r]), _problems(infos, flags, r)


def _check_streams(infos, ckpt_dir: Path, last_good_round: int) -> list[str]:
    """The chunk's flagged participants (:func:`stream_problems`). A flagged client was excluded from every
    aggregate (the engine withholds the stream of a client that reported an invalid input, and the server
    drops a stream it cannot decode, ``RoundInfo.included``): the round goes on without it and this returns
    one warning per such round. A round with no participant left, or a client that could not decode its
    downlink (its next update would start from a model the server does not have), stops the run like NaN
    (:class:`InvalidStreamError`): nothing from that round is kept."""
    flags = _flags(infos)
    if not flags.bad.any():
        return []
    stop = ~flags.included.any(axis=1) | (flags.down != 0).any(axis=1)
    rounds = np.asarray(infos.round_index)
    if stop.any():
        r = int(np.flatnonzero(stop)[0])
        raise InvalidStreamError(
            f"an invalid stream in round {int(rounds[r])} ({_problems(infos, flags, r)}). Nothing from that "
            f"round was kept: the last good state (round {last_good_round}) is checkpointed in {ckpt_dir}. "
            f"This is a bug or a corrupted input, not a tuning problem: please report it."
        )
    return [
        f"warning: round {int(rounds[r]) + 1}: excluded from the server's aggregates: "
        f"{_problems(infos, flags, r)}"
        for r in np.flatnonzero(flags.bad.any(axis=1))
    ]


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


class Rounds(NamedTuple):
    """What the rounds run: the algorithm (:class:`sidejax.fl.Algorithm`) on the clients' data ``fed``, with
    the run's round keys (``run_keys(seed)[1]``) and client map
    (:func:`experiments.algorithms.client_map`); ``clients_per_step`` (``run.clients_per_step``): each
    round's participants in parts of that many (``None``: chunks of whole rounds)."""

    algorithm: Any
    fed: Any
    rounds_key: jax.Array
    client_map: Any
    clients_per_step: int | None = None

    def in_parts(self) -> bool:
        """Whether the rounds run in parts: ``clients_per_step`` set and below the participants."""
        step = self.clients_per_step
        return step is not None and step < self.algorithm.clients_per_round

    def partial_like(self, state):
        """A :class:`sidejax.fl.PartialRound` shaped like the ones of ``state``'s rounds (shapes only are
        computed), the template a checkpoint inside a round is restored into."""
        shapes = jax.eval_shape(
            lambda s: start_round(self.algorithm, self.rounds_key, s, self.fed, client_map=self.client_map),
            state,
        )
        return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)


def start_rounds(config: ExperimentConfig, prepared) -> tuple[Any, int, Rounds]:
    """The run's initial ``RoundState`` (from ``run.init_from``'s final model if set, e.g. BPC-FL's MAP
    estimate as FedAvg's start, docs/papers/bpcfl.md#a6), its number of parameters and its :class:`Rounds`.

    One round is traced (shapes only, nothing compiled or run) before anything is written: a configuration
    the algorithm refuses at trace time (e.g. a coreset larger than a client's data) fails here, not after
    the run folder exists."""
    algorithm, fed = prepared.algorithm, prepared.fed
    init_key, rounds_key = run_keys(config.run.seed)
    params = init_params(init_key, prepared.spec)
    if config.run.init_from:
        params, _ = load_init_params(config.run.init_from, params)
    num_params = count_params(params)
    state = algorithm.init(init_key, params, int(fed.num_examples.shape[0]))
    cmap = client_map(config)
    jax.eval_shape(build_round_step(algorithm, client_map=cmap), round_key(rounds_key, 0), state, fed)
    return state, num_params, Rounds(algorithm, fed, rounds_key, cmap, config.run.clients_per_step)


def host_view(config: ExperimentConfig, tree):
    """``tree`` whole on the host: on a mesh of several processes each holds its own devices' shares, and
    this gathers them (a collective); one process sees every share already."""
    return gather_to_host(tree) if config.run.processes > 1 else tree


def lost_process(config: ExperimentConfig, records: Records):
    """Within it, several processes: a collective that fails (another process died) stops this one with a
    clear error saying where the last checkpoint is (:func:`experiments.distributed.lost_process_error`)."""
    return distributed.lost_process_error(
        config.run,
        lambda: (
            f"the last checkpoint in {records.out} is at round {records.done}; start every process again "
            f"with --resume (the same --run.processes and --run.devices) to continue"
        ),
    )


def run_chunks(
    config: ExperimentConfig,
    rounds: Rounds,
    state,
    evaluator: Evaluator,
    records: Records,
    *,
    progress: bool,
    verbose: bool,
):
    """Runs the rounds from ``records.done`` to ``run.rounds`` in chunks of ``run.eval_every``; returns the
    last state. Each chunk's flags are checked before its state is accepted or checkpointed (the last good
    state stays on disk): NaN/inf (:class:`NonFiniteError`), then the coders' input flags and the server's
    stream errors (:class:`InvalidStreamError`). Then the state is evaluated after the chunk's last round
    and recorded (:meth:`experiments.driver_records.Records.record`); ``run.stop_at_accuracy`` ends the run
    early. ``progress``: a tqdm bar; ``verbose``: the per-round table."""
    from tqdm.auto import tqdm

    target, stop_at = config.run.rounds, config.run.stop_at_accuracy
    if verbose:
        print(
            f"{config.algorithm} on {config.data.dataset}/{config.data.model}: {records.num_params:,} "
            f"parameters, {config.data.num_clients} clients ({config.clients_per_round} per round), "
            f"output {records.out}"
        )
        print(PERSONAL_TABLE_HEADER if evaluator.personal else TABLE_HEADER)
    bar = tqdm(total=target, initial=records.done, disable=not progress, unit="round", leave=False)
    with interrupts.deferring():
        while records.done < target:
            done = records.done
            chunk = min(config.run.eval_every, target - done)
            for new_state, infos, last in _chunk_steps(config, rounds, state, records, chunk):
                _check_finite(infos, records.ckpt_dir, records.done)
                for warning in _check_streams(infos, records.ckpt_dir, records.done):
                    print(warning, file=sys.stderr)
                state = new_state
                view = host_view(config, state)
                scores = evaluator(view) if last else evaluator.unscored()
                own = algorithm_metrics(rounds.algorithm, infos, records.num_params)
                _warn_divergences(own, records.done, config)
                new_rows = records.record(view, infos, own, scores)
                if verbose:
                    for r in new_rows:
                        bar.write(format_row(r))
                bar.update(len(new_rows))
                interrupts.stop_point()
            if stop_at is not None and scores["test_accuracy"] >= stop_at:
                if verbose:
                    bar.write(f"reached run.stop_at_accuracy={stop_at} at round {records.done}")
                break
    bar.close()
    return state


def _chunk_steps(config: ExperimentConfig, rounds: Rounds, state, records: Records, chunk: int):
    """The steps of a chunk of ``chunk`` rounds from ``state``, each ``(state, infos, last)``: ``infos``
    stacked over its rounds, ``last`` whether it ends the chunk (then evaluated). Whole rounds: one step,
    one jit call. In parts (``run.clients_per_step``): one step per round, each round's participants in
    parts, with a checkpoint of the round so far after every part but the last (a resume runs only the
    participants not yet run; a Ctrl-C stops there) and the server's update once all have run."""
    algorithm, fed, key, cmap = rounds.algorithm, rounds.fed, rounds.rounds_key, rounds.client_map
    if not rounds.in_parts():
        yield (*run_rounds(algorithm, key, state, fed, chunk, client_map=cmap), True)
        return
    total = algorithm.clients_per_round
    for s in range(chunk):
        partial, records.partial = records.partial, None  # a resumed round continues where it stopped
        if partial is None:
            partial = start_round(algorithm, key, state, fed, client_map=cmap)
        while int(partial.clients_done) < total:
            num = min(rounds.clients_per_step, total - int(partial.clients_done))
            partial = run_clients(algorithm, key, state, fed, partial, num, client_map=cmap)
            if int(partial.clients_done) < total:
                records.record_part(host_view(config, state), host_view(config, partial))
                interrupts.stop_point()
        new_state, info = finish_round(algorithm, key, state, fed, partial, client_map=cmap)
        state = new_state
        yield state, jax.tree.map(lambda a: a[None], info), s == chunk - 1
