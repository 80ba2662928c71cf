"""One experiment over several processes (hosts), on JAX's own runtime (``jax.distributed``).

Every process runs the same driver on the same configuration; the round engine's mesh spans the devices of
all of them (``run.devices`` counts every device of every process), so one round's participants are split
over all the devices, and the collectives (the server's gathers and reductions) run over JAX's transport:
NCCL on GPUs, ICI/DCN on TPUs, gloo on CPUs. Nothing here is an RPC layer of ours.

Start::

    # on host 0 (and the same on host 1 with --run.process_id 1)
    python -m experiments.run --preset NAME --run.processes 2 --run.devices 8 \\
        --run.coordinator 10.0.0.1:8476 --run.process_id 0

What each process does (:mod:`experiments.driver`):

- :func:`start` connects it to the others (``jax.distributed.initialize``) before JAX starts its backend;
  on CPU it selects the gloo collectives. A process other than 0 that cannot reach the coordinator's port
  within ``INIT_TIMEOUT_S`` stops with an error naming the address (checked before JAX's own connection,
  whose timeout aborts the interpreter with a C++ log); process 0 says on stderr that it waits for the
  others, and if they do not all come within ``INIT_TIMEOUT_S``, JAX aborts it (exit status 134).
- :func:`check_same_config` compares a fingerprint of the configuration (every field but the launch
  settings ``run.coordinator`` and ``run.process_id``) across the processes before anything is written:
  processes started with different flags all stop, each naming the processes that differ.
- each process builds the federation from the seed and places only its own devices' shares of the
  examples and the client state (:func:`sidejax.fl.place_federation`);
- only process 0 writes the results folder, which every process must be able to read (a shared
  filesystem: ``--resume`` reads the checkpoint in every process);
- a process that dies is noticed by the others in the round loop (:func:`lost_process_error`), and they
  stop with exit status 4 and a message naming the last checkpoint, instead of waiting forever; that
  checkpoint is intact and ``--resume`` on the same topology continues it. Two things notice it: the
  collective that waits on the lost process, when the transport reports the broken connection (gloo
  usually does, within a second), and a watch of our own: every process writes a count to the
  coordination service's key-value store each second and reads the others'; one that has not changed
  for ``LOST_AFTER_S`` (half the heartbeat timeout) is taken for lost. The watch is needed because a
  collective can also wait forever on a process killed mid-exchange (measured: 1 kill in 10 here), and
  then JAX's own heartbeat (``HEARTBEAT_TIMEOUT_S``) ends the waiting process from C++ (exit status
  134, a page of log and no word on the checkpoint). Outside the round loop (joining, the configuration
  check, writing the results) JAX's heartbeat is what stops them. One more outcome is outside Python: on
  CPU, gloo itself sometimes aborts the waiting process when the lost one died halfway through sending a
  message ("gloo::EnforceNotMet ... Received data size doesn't match expected size", exit status 134;
  about 1 kill in 15 here). The checkpoint is intact then too, and ``--resume`` continues it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from experiments import interrupts
from experiments.config import LAUNCH_FIELDS, ExperimentConfig, RunConfig

__all__ = [
    "LAUNCH_FIELDS",
    "ProcessLostError",
    "start",
    "check_same_config",
    "fingerprint",
    "is_writer",
    "lost_process_error",
    "topology",
]

#: seconds a process waits for the others to connect (``jax.distributed.initialize``)
INIT_TIMEOUT_S = int(os.environ.get("SIDEJAX_DIST_INIT_TIMEOUT_S", "120"))
#: seconds without a heartbeat after which the coordination service declares a process dead
HEARTBEAT_TIMEOUT_S = int(os.environ.get("SIDEJAX_DIST_HEARTBEAT_TIMEOUT_S", "30"))
#: seconds without a sign of life from another process (its count in the key-value store unchanged) after
#: which a process in the round loop stops with exit status 4; below HEARTBEAT_TIMEOUT_S, so that this
#: clear stop comes before JAX's own, which aborts the interpreter
LOST_AFTER_S = float(os.environ.get("SIDEJAX_DIST_LOST_AFTER_S", HEARTBEAT_TIMEOUT_S / 2))
#: seconds between two signs of life
BEAT_S = 1.0
#: exit status of a process that stopped because another one was lost
LOST_STATUS = 4


def start(run: RunConfig) -> None:
    """Joins this process to a ``run.processes``-process run; does nothing for a single process.

    Must run before anything starts JAX's backend (the first array, ``jax.devices()``). Calling it again
    in a process already joined to the same number of processes does nothing.

    Raises:
      ValueError: the process was already joined to a different run, or JAX's backend already started.
    """
    if run.processes == 1:
        return
    if jax.distributed.is_initialized():
        if jax.process_count() != run.processes or jax.process_index() != run.process_id:
            raise ValueError(
                f"this process already joined a run of {jax.process_count()} processes as process "
                f"{jax.process_index()}, not run.processes={run.processes}, run.process_id={run.process_id}"
            )
        return
    if run.process_id > 0:
        _wait_for_coordinator(run)
    else:
        print(
            f"process 0: waiting up to {INIT_TIMEOUT_S} s for the other {run.processes - 1} process(es) "
            f"to join at {run.coordinator}",
            file=sys.stderr,
            flush=True,
        )
    # CPU devices talk through gloo (the default CPU collectives cannot cross processes); harmless elsewhere
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=run.coordinator,
            num_processes=run.processes,
            process_id=run.process_id,
            initialization_timeout=INIT_TIMEOUT_S,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        )
    except RuntimeError as exc:
        raise ValueError(
            f"process {run.process_id} of {run.processes} could not join the run at run.coordinator="
            f"{run.coordinator!r} within {INIT_TIMEOUT_S} s ({exc}); start every process with the same "
            "--run.coordinator (process 0's host:port) and --run.processes, each with its own "
            "--run.process_id"
        ) from exc


def _wait_for_coordinator(run: RunConfig) -> None:
    """Waits until process 0's port accepts a connection, or raises ``ValueError`` after INIT_TIMEOUT_S."""
    host, _, port = (run.coordinator or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"run.coordinator must be host:port (process 0's address), got {run.coordinator!r}")
    deadline = time.monotonic() + INIT_TIMEOUT_S
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"process {run.process_id} of {run.processes} could not reach process 0 at "
                    f"run.coordinator={run.coordinator!r} within {INIT_TIMEOUT_S} s ({exc}): start process 0 "
                    "(--run.process_id 0) on that host and port (SIDEJAX_DIST_INIT_TIMEOUT_S sets the wait)"
                ) from exc
            time.sleep(0.5)


def topology() -> dict[str, int]:
    """This run's processes and devices (what a checkpoint resumes on)."""
    return {"processes": jax.process_count(), "devices": jax.device_count()}


def fingerprint(config: ExperimentConfig) -> str:
    """SHA-256 of the configuration without its launch settings (:data:`LAUNCH_FIELDS`), and of the
    versions of jax and sidejax (processes on different versions could compile different programs)."""
    import sidejax

    flat = {k: v for k, v in config.flat().items() if k not in LAUNCH_FIELDS}
    text = json.dumps(
        {"config": flat, "jax": jax.__version__, "sidejax": getattr(sidejax, "__version__", "")},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def check_same_config(config: ExperimentConfig) -> None:
    """Every process of the run holds the same configuration, and the run has the topology it asks for.

    A collective: every process must call it. It is the driver's first collective, so it also waits until
    every process got this far (every process has checked the results folder before process 0 writes it).

    Raises:
      ValueError: in every process, naming the processes whose configuration differs from process 0's, or
        the topology that differs from ``run.processes`` / ``run.devices``.
    """
    run = config.run
    if jax.process_count() != run.processes:
        raise ValueError(
            f"run.processes={run.processes} but JAX runs {jax.process_count()} process(es): call "
            "experiments.distributed.start(config.run) before anything uses JAX"
        )
    if run.processes > 1 and jax.device_count() != run.devices:
        raise ValueError(
            f"run.devices={run.devices} but the {run.processes} processes have {jax.device_count()} devices "
            f"together ({jax.local_device_count()} here): with several processes the mesh spans every "
            "device, "
            f"so set --run.devices {jax.device_count()}"
        )
    if run.processes == 1:
        return
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes.fromhex(fingerprint(config)), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 32]
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(
            f"the processes were started with different configurations: process(es) {differ} differ from "
            "process 0 (a fingerprint of every setting but run.coordinator and run.process_id, and of the "
            "jax "
            "and sidejax versions); start every process with the same preset and flags"
        )


def is_writer() -> bool:
    """Whether this process writes the results folder (process 0)."""
    return jax.process_index() == 0


class ProcessLostError(RuntimeError):
    """A collective with the run's other processes failed: most likely one of them stopped (see
    :func:`lost_process_error`). The command line exits with status 4 without JAX's shutdown barrier, which
    would wait for the lost process and then abort."""


@contextlib.contextmanager
def lost_process_error(run: RunConfig, what_now: Callable[[], str]):
    """The round loop of a run of several processes: a lost process stops this one with a clear error.

    Within it, a failed collective (``jax.errors.JaxRuntimeError``: gloo's "connection reset by peer", the
    coordination service's "heartbeat timeout") becomes a :class:`ProcessLostError` naming this process and
    ``what_now()`` (e.g. where the last checkpoint is); and a watch thread (see the module docstring) ends
    the process with exit status 4 and the same message when another process gives no sign of life for
    :data:`LOST_AFTER_S` seconds, or the coordinator cannot be reached for as long: the case where a
    collective waits forever on the lost process. Leaving normally tells the others that this process is
    done (it is not lost when it then stops); leaving by an exception does not. A single process re-raises
    JAX's error unchanged and runs no watch."""
    watch = _Watch.start(run, what_now) if run.processes > 1 else None
    left = False
    try:
        yield
        left = True
    except jax.errors.JaxRuntimeError as exc:
        if run.processes == 1:
            raise
        first = str(exc).strip().splitlines()[0][:300]
        raise ProcessLostError(
            _lost_message(run, f"a collective with the other processes failed ({first})", what_now)
        ) from exc
    finally:
        if watch is not None:
            watch.close(left=left)


def _lost_message(run: RunConfig, why: str, what_now: Callable[[], str]) -> str:
    """What a process says when another one of its run is lost: which process, ``why``, and ``what_now()``."""
    return (
        f"process {run.process_id} of {run.processes}: {why}; another process of this run has most likely "
        f"stopped (see its log). {what_now()}"
    )


def _coordination_client():
    """JAX's client of the coordination service (the key-value store), or ``None`` when this JAX has none
    where :mod:`jax.experimental.multihost_utils` finds it."""
    try:
        from jax._src import distributed as jax_distributed
    except ImportError:  # pragma: no cover - a JAX that moved it: the watch is off, JAX's heartbeat remains
        return None
    return getattr(getattr(jax_distributed, "global_state", None), "client", None)


class _Watch:
    """Signs of life between the processes of a run, through the coordination service's key-value store.

    Each process sets ``sidejax/alive/<process_id>`` to a count that grows every :data:`BEAT_S` seconds
    and reads every other process's; a process whose count has not changed for :data:`LOST_AFTER_S`
    seconds (counted from this watch's start for one not seen yet), or a store that cannot be reached for
    as long, ends this process (:meth:`lost`). A process done with the round loop sets its key to
    ``"left"``, and is not waited for any more."""

    PREFIX = "sidejax/alive/"

    def __init__(self, run: RunConfig, what_now: Callable[[], str], client) -> None:
        self.run, self.what_now, self.client = run, what_now, client
        self.key = f"{self.PREFIX}{run.process_id}"
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="sidejax-peers", daemon=True)

    @classmethod
    def start(cls, run: RunConfig, what_now: Callable[[], str]) -> _Watch | None:
        client = _coordination_client()
        if client is None:
            return None
        watch = cls(run, what_now, client)
        watch.thread.start()
        return watch

    def close(self, *, left: bool) -> None:
        """Stops the watch; ``left``: tell the others this process is done (it may stop now)."""
        self.closed.set()
        if left:
            # after the thread's last count, which would otherwise overwrite "left" and read as silence
            self.thread.join(timeout=BEAT_S + 30)
            with contextlib.suppress(Exception):
                self.client.key_value_set(self.key, "left", allow_overwrite=True)

    def _loop(self) -> None:
        others = [p for p in range(self.run.processes) if p != self.run.process_id]
        start = time.monotonic()
        last = {p: (None, start) for p in others}  # the count last seen, and when it changed
        unreachable = None  # (since when, the error) the store could not be reached
        count = 0
        while not self.closed.is_set():
            count += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(self.key, str(count), allow_overwrite=True)
                seen = dict(self.client.key_value_dir_get(self.PREFIX))
                unreachable = None
            except Exception as exc:  # the coordinator (process 0) is gone, or the RPC failed
                unreachable = unreachable or (now, exc)
                if now - unreachable[0] >= LOST_AFTER_S:
                    self.lost(
                        f"the run's coordinator (process 0 at {self.run.coordinator}) could not be reached "
                        f"for {LOST_AFTER_S:g} s ({str(unreachable[1]).strip().splitlines()[0][:200]})"
                    )
                self.closed.wait(BEAT_S)
                continue
            silent = []
            for p in others:
                value = seen.get(f"{self.PREFIX}{p}")
                if value == "left":
                    continue
                if value != last[p][0]:
                    last[p] = (value, now)
                elif now - last[p][1] >= LOST_AFTER_S:
                    silent.append(p)
            if silent:
                self.lost(f"process(es) {silent} gave no sign of life for {LOST_AFTER_S:g} s")
            self.closed.wait(BEAT_S)

    def lost(self, why: str) -> None:
        """Prints why and what now, and ends the process (exit status 4) once no file is being written."""
        with interrupts.writing():
            if self.closed.is_set():  # the main thread got there first (a failed collective) or is done
                return
            print(f"stopped: {_lost_message(self.run, why, self.what_now)}", file=sys.stderr)
            interrupts.flush_output()
            os._exit(LOST_STATUS)
