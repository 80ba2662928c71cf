"""Shared parts of the benchmark scripts in :mod:`experiments.bench`: the command line from a table of flags
(with ``--quick`` / full defaults), the interleaved timing (wall and process CPU time, best or all of the
repeats), the benchmark's own subprocesses, the machine record and the JSON report writer.

Every benchmark JSON records how it was measured (:func:`machine_record`): the threads (``XLA_FLAGS`` in
force, PyTorch's thread counts where it ran, the cores the process may use), the load average before and
after the run, and CPU time beside wall time for every timed contestant (:func:`timing`). Wall times on a
shared machine are comparable only within one run; the CPU time and the load say how far to trust them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple


def fill_defaults(args, quick: dict, full: dict) -> None:
    """Sets each flag of ``args`` left at ``None`` to its ``quick`` value (``args.quick``) or ``full`` one."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


#: ``XLA_FLAGS`` for one thread in XLA's CPU matrix products and convolutions (set before jax is imported).
#: XLA has no flag for the size of its own intra-op pool, which runs the compiled program's operations
#: and splits large loops: the pool has one thread per core the process may use when jax starts, so a
#: single-threaded run also needs the process pinned to one core before jax is imported (:func:`pinned`,
#: :func:`run_pinned`; measured: unpinned on 2 cores, a BICompFL encode's CPU time fell 60/40 to 80/20 on two
#: pool threads, pinned from the start all of it on one). The ``intra_op_parallelism_threads=1`` these flags
#: used to carry is no XLA flag: a word without ``--`` after a flag is ignored (as the first word, XLA reads
#: it as a file of flags and aborts).
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages now (``None`` where the platform has none). A benchmark
    records them before and after its run: on a machine shared with other jobs its wall times are only
    comparable within one run, and the load says how busy the cores were."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_affinity() -> list[int] | None:
    """The cores this process may run on (``os.sched_getaffinity``; ``None`` where there is none)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


@contextlib.contextmanager
def pinned(cores: list[int] | None):
    """Runs the ``with`` body on ``cores`` only (``None``: as the process is): every thread of this process,
    those already started (jax's, PyTorch's pools) and those started later, and child processes (they
    inherit the mask), with ``os.sched_setaffinity``; the previous mask is restored on exit. Yields the
    cores in force. XLA's single-thread flags leave its intra-op pool at one thread per usable core
    (:data:`SINGLE_THREAD_XLA_FLAGS`), so comparing two libraries "single-threaded" needs the same cores for
    both, not only thread counts; pinned to one core, a timed call's CPU time equals its wall time (less
    what other jobs took). Pinned before jax is imported, XLA's pool has one thread."""
    if cores is None:
        yield cpu_affinity()
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cores: this platform cannot pin a process to cores (no os.sched_setaffinity)")
    before = os.sched_getaffinity(0)
    if not cores or not set(cores) <= before:
        raise ValueError(
            f"cores must be a non-empty subset of the usable cores {sorted(before)}, got {cores}"
        )
    _set_affinity(set(cores))
    try:
        yield cpu_affinity()
    finally:
        _set_affinity(before)


def _set_affinity(cores: set[int]) -> None:
    """Sets the affinity of every thread of this process (``sched_setaffinity`` of pid 0 sets only the
    calling thread's on Linux)."""
    tasks = Path("/proc/self/task")
    for tid in [0] + ([int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else []):
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass


#: the ``--threads`` and ``--cores`` flags of the benchmarks that compare two libraries on the same cores
#: (:func:`check_threads_and_cores`, :func:`run_pinned`)
THREAD_FLAGS = {
    "--threads": (int, 1, "1: both single-threaded; 0: library defaults"),
    "--cores": (str, None, "cores both run on: 0, 0,1 or 0-3 (default: the first usable one; all: unpinned)"),
}


def check_threads_and_cores(p: argparse.ArgumentParser, args) -> None:
    """Validates the parsed :data:`THREAD_FLAGS` (``p.error`` names the flag) and turns ``args.cores`` into
    the core list to pin to (:func:`parse_cores`)."""
    if args.threads not in (0, 1):
        p.error(f"--threads takes 0 or 1, got {args.threads}")
    try:
        args.cores = parse_cores(args.cores)
    except ValueError as err:
        p.error(str(err))


def run_pinned(module: str, args, argv: list[str] | None, run) -> dict:
    """Runs ``run()`` (a benchmark's measurement; returns its report) on ``args.cores`` (:func:`pinned`) and,
    with ``args.threads == 1``, under :data:`SINGLE_THREAD_XLA_FLAGS`. XLA reads its flags when jax is
    imported: when they are not in force and jax is imported already (``main()`` called from Python), the
    benchmark runs again as ``python -m module *argv`` in a fresh interpreter, which inherits the cores, and
    the JSON it wrote (``args.output``) is returned."""
    with pinned(args.cores):
        if args.threads == 1 and SINGLE_THREAD_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            if "jax" in sys.modules:
                cmd = [sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)]
                subprocess.run(cmd, env=single_thread_env(), check=True)
                return json.loads(Path(args.output).read_text())
            os.environ.update(single_thread_env())
        return run()


def parse_cores(text: str | None) -> list[int] | None:
    """A ``--cores`` value as the sorted core numbers to pin to (:func:`pinned`): ``"0"``, ``"0,1"`` or
    ``"0-3"``; ``None`` (the flag not given) is one core, the first this process may use; ``"all"`` is
    ``None``, no pinning. Raises ``ValueError`` naming ``--cores`` for anything else or a core not usable."""
    if text == "all":
        return None
    usable = set(cpu_affinity() or [])
    if text is None:
        return [min(usable)] if usable else None
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"--cores takes core numbers such as 0, 0,1 or 0-3, or all, got {text!r}")
        cores.update(range(int(lo), int(hi or lo) + 1))
    if usable and not cores <= usable:
        raise ValueError(
            f"--cores {text}: cores {sorted(cores - usable)} are not usable here ({sorted(usable)})"
        )
    return sorted(cores)


def torch_single_thread(torch) -> None:
    """PyTorch on one intra-op and (where it is not fixed yet in this process) one inter-op thread."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or parallel work already started) in this process
        pass


def threads_record(torch=None) -> dict:
    """The threads a benchmark ran with: the ``XLA_FLAGS`` in force (read when jax was imported, so set
    before), whether they are :data:`SINGLE_THREAD_XLA_FLAGS`, the cores the process may run on, the OS
    threads it has now, and, where PyTorch was used (``torch``, the module), its intra-op and inter-op
    thread counts (``None`` otherwise)."""
    flags = os.environ.get("XLA_FLAGS", "")
    tasks = Path("/proc/self/task")
    return {
        "xla_flags": flags,
        "xla_single_thread": SINGLE_THREAD_XLA_FLAGS in flags,
        "cpu_affinity": cpu_affinity(),
        "process_threads": len(list(tasks.iterdir())) if tasks.is_dir() else None,
        "torch_threads": None
        if torch is None
        else {"intra_op": torch.get_num_threads(), "interop": torch.get_num_interop_threads()},
    }


def machine_record(*, load_before: list[float] | None, torch=None, **versions: str) -> dict:
    """The machine and threads a benchmark ran on, recorded in every benchmark JSON: JAX devices and
    backend, CPU counts, :func:`threads_record` (``torch``: the PyTorch module where it was timed), the load
    average before the run (``load_before``, :func:`load_average` called as the run started) and after it
    (read now), the platform, JAX's and numpy's versions, then ``versions`` (e.g.
    ``scipy_version=scipy.__version__``) in the order given."""
    import jax
    import numpy as np

    record = {
        "devices": [str(dev) for dev in jax.devices()],
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(cpu_affinity() or []) or None,
        "threads": threads_record(torch),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "platform": platform.platform(),
        "jax_version": jax.__version__,
        "numpy_version": np.__version__,
    }
    if torch is not None:
        record["torch_version"] = torch.__version__
    record.update(versions)
    return record


def write_json(report: dict, out, *, trailing_newline: bool = True) -> Path:
    """Writes ``report`` as indented JSON to ``out`` (parents created); returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + ("\n" if trailing_newline else ""))
    return out


def write_report(report: dict, out, *, table: str | None = None, trailing_newline: bool = True) -> Path:
    """:func:`write_json`, then prints ``table`` (if given) and ``wrote <out>``; returns the path."""
    out = write_json(report, out, trailing_newline=trailing_newline)
    if table is not None:
        print(table)
    print(f"wrote {out}")
    return out


def single_thread_env(env=None) -> dict:
    """``env`` (default this process's environment) with :data:`SINGLE_THREAD_XLA_FLAGS` added to
    ``XLA_FLAGS`` (once)."""
    env = dict(os.environ if env is None else env)
    flags = env.get("XLA_FLAGS", "")
    if SINGLE_THREAD_XLA_FLAGS not in flags:
        env["XLA_FLAGS"] = f"{flags} {SINGLE_THREAD_XLA_FLAGS}".strip()
    return env


def clock(fn, *args):
    """``(result, wall seconds, process CPU seconds)`` of ``fn(*args)``, its JAX values waited for. CPU time
    counts every thread of this process but not the time spent waiting for a core: on a machine shared with
    other jobs it is the steadier of the two."""
    import jax

    t0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0, time.process_time() - c0


def interleave(calls: dict, repeats: int) -> tuple[dict, dict]:
    """Calls every ``calls[name]()`` in turn, ``repeats`` times over, so that a change of machine load falls
    on every contestant alike. Returns ``(times, outputs)``: per name the ``[(wall, cpu), ...]`` seconds of
    each call (:func:`clock`), and its last result."""
    times: dict = {name: [] for name in calls}
    outputs: dict = {}
    for _ in range(repeats):
        for name, fn in calls.items():
            outputs[name], wall, cpu = clock(fn)
            times[name].append((wall, cpu))
    return times, outputs


def best(times: dict) -> dict:
    """Per name, ``(best wall, best CPU)`` seconds of :func:`interleave`'s ``times`` (each minimum taken
    on its own)."""
    return {name: (min(w for w, _ in t), min(c for _, c in t)) for name, t in times.items()}


def timing(samples: list[tuple[float, float]]) -> dict:
    """One contestant's timed calls as a benchmark JSON records them: ``samples`` are its ``(wall, CPU)``
    seconds (:func:`interleave`); returns all of both, their medians and minima, and ``cpu_over_wall``
    (total CPU / total wall): about 1 for one busy thread on a core of its own, above 1 when more threads
    worked (XLA's single-thread flags leave two busy unless the process is pinned, :func:`pin_cores`),
    below 1 when other jobs took the core."""
    import numpy as np

    wall, cpu = [w for w, _ in samples], [c for _, c in samples]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "median_wall_s": float(np.median(wall)),
        "median_cpu_s": float(np.median(cpu)),
        "best_wall_s": min(wall),
        "best_cpu_s": min(cpu),
        "cpu_over_wall": sum(cpu) / max(sum(wall), 1e-12),
    }


def candidate_floor(p, num_candidates: int, chunk_size: int, num_samples: int = 1):
    """The work no importance-sampling encoder of ``num_samples`` samples of ``K = num_candidates``
    candidates per coordinate can skip, as a jitted ``shared_key -> float32``: per sample (its key
    ``fold_in(shared_key, sample)``), the ``K x dim`` candidate uniforms from the coder's own generator
    (:func:`sidejax.coding.importance.chunk_uniforms`, in chunks of ``chunk_size`` coordinates as the
    encoder takes them) turned into candidates by the coder's
    :func:`sidejax.coding.importance.candidate_values` against the prior ``p`` (``dim`` coordinates),
    summed over the candidates. Timed in the same run on the same cores, it is the floor an encoder's time
    is checked against (:func:`check_above_floor`): a figure below it is a measurement error (threads not
    counted, work skipped), not a fast encoder."""
    import jax
    import jax.numpy as jnp

    from sidejax.coding.importance import candidate_values, chunk_uniforms

    gen = chunk_uniforms
    dim = jax.tree.leaves(p)[0].shape[0]
    full, rest = divmod(dim, chunk_size)

    def chunk(key, start, length):
        u = gen(key, num_candidates, start, length)
        pc = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, length), p)
        return jnp.sum(candidate_values(pc, u).astype(jnp.float32), axis=0)

    def one(key):
        acc = jax.lax.scan(
            lambda acc, c: (acc + chunk(key, c * chunk_size, chunk_size), None),
            jnp.zeros((chunk_size,), jnp.float32),
            jnp.arange(full),
        )[0]
        total = jnp.sum(acc)
        return total + jnp.sum(chunk(key, full * chunk_size, rest)) if rest else total

    keys = lambda key: jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(num_samples))
    return jax.jit(lambda key: jnp.sum(jax.lax.map(one, keys(key))))


#: an encoder's CPU time may fall this far below :func:`candidate_floor`'s before a benchmark refuses the
#: figure. With Threefry candidates (stream format 1) generation dominated and BICompFL's encode took
#: 0.91-1.85x of the floor on one core: the floor was a floor. With the counter hash (format 2) generating a
#: candidate costs less than reading it back, and the encoder, whose reading XLA fuses into its per-block
#: sums, runs below this unfused program: 0.51-0.58x at LeNet5 size (one pinned core) and 0.22x at CONV6
#: size (d = 2,262,602, K = 256, quiet machine). So the ratio is reported, not trusted as a bound, and only
#: an order of magnitude below it (work skipped, a cached result) is refused; threads are accounted for by
#: reporting CPU time and pinning, not by this check.
FLOOR_TOLERANCE = 0.1


def check_above_floor(name: str, seconds: float, floor_seconds: float) -> float:
    """``seconds / floor_seconds`` (CPU times of the same run); raises ``RuntimeError`` naming ``name``
    when it is below :data:`FLOOR_TOLERANCE`, i.e. when a benchmark would report an encoder faster than
    generating its candidates."""
    ratio = seconds / floor_seconds
    if ratio < FLOOR_TOLERANCE:
        raise RuntimeError(
            f"{name}: {seconds:.4g} s CPU is {ratio:.2f}x the candidate-generation program measured in the "
            f"same run ({floor_seconds:.4g} s): below {FLOOR_TOLERANCE}x the work cannot have been done; "
            "the measurement is wrong (work skipped, or a cached result)"
        )
    return ratio


def rel_diff(a, b) -> float:
    """``max|a − b| / max|b|`` in float64 (the denominator floored at 1e-30)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def child_json(cmd: list[str], *, tag: str = "", env=None, timeout: float | None = None) -> dict:
    """Runs ``cmd`` (a benchmark's own subprocess) and returns the JSON on the last line of its output that
    starts with ``tag``; raises ``RuntimeError`` with the end of its stderr when it fails."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag) and ln.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(cmd[1:])} failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len(tag) :])


class Sized(NamedTuple):
    """A flag's default that differs between the full run and ``--quick``."""

    full: Any
    quick: Any


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose flags with a :class:`Sized` default, left unset, take their ``--quick`` or
    full value after parsing (:func:`fill_defaults`)."""

    sized: dict

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if self.sized:  # a table with sized defaults has --quick
            quick = {dest: d.quick for dest, d in self.sized.items()}
            fill_defaults(parsed, quick, {dest: d.full for dest, d in self.sized.items()})
        return parsed


def parser(module: str, doc: str, flags: dict, *, out: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``python -m <module>`` (its description: ``doc``'s first paragraph) from a
    table: ``flags`` maps each flag to ``(type, default, help)``. A ``type`` of ``[int]`` (a one-item list)
    takes one or more values; ``bool`` is a switch (with ``--no-<flag>`` too when its default is sized); a
    :class:`Sized` default differs between ``--quick`` and the full run, filled in by ``parse_args`` when
    the flag is not given. ``out`` adds ``--out``, the JSON path, with that default."""
    p = _Parser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    p.sized = {}
    for flag, (kind, default, help_) in flags.items():
        sized = isinstance(default, Sized)
        if sized:
            help_ = f"{help_ or ''} (default {default.full}; --quick {default.quick})".lstrip()
            p.sized[flag.lstrip("-").replace("-", "_")] = default
        if kind is bool:  # a switch; a sized one has --no-<flag> too
            action = argparse.BooleanOptionalAction if sized else "store_true"
            p.add_argument(flag, action=action, default=None if sized else False, help=help_)
            continue
        nargs = "+" if isinstance(kind, list) else None
        kind = kind[0] if nargs else kind
        p.add_argument(flag, type=kind, nargs=nargs, default=None if sized else default, help=help_)
    if out is not None:
        p.add_argument("--out", default=out, help=f"JSON output path (default {out})")
    return p


def fashion_mnist(n: int):
    """``(x [n, 28, 28, 1] float32, y [n] int32, real)``: the first ``n`` Fashion-MNIST training images, or,
    when its files are not installed (``real`` false, to be flagged in the JSON), random images of the same
    shape with random labels (seed 0)."""
    import numpy as np

    from sidejax.data import dataset_available, load_dataset

    if dataset_available("fashion_mnist"):
        train = load_dataset("fashion_mnist", "train")
        return np.asarray(train.x[:n], np.float32), np.asarray(train.y[:n], np.int32), True
    rng = np.random.default_rng(0)
    return rng.random((n, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32), False


#: the convolutions a LeNet5 benchmark can trace inside (:mod:`sidejax.models.conv`): the models' own, without
#: banded matrix products, as before issue 12 (JAX's input gradient), and plain ``lax.conv_general_dilated``
CONVS = ("sidejax", "no_banded", "kernel_only", "lax")


def conv_context(name: str):
    """The context manager (entered while tracing) that selects the convolution ``name`` of :data:`CONVS`."""
    import contextlib

    from sidejax.models import conv

    contexts = {
        "sidejax": contextlib.nullcontext,
        "no_banded": conv.no_banded_matmul,
        "kernel_only": conv.lax_input_gradient,
        "lax": conv.plain_lax_convolution,
    }
    return contexts[name]()


def text_table(columns: list[tuple[str, str]], rows: list[list]) -> list[str]:
    """The lines of a fixed-width table: a header, a rule, then a line a row. ``columns`` are
    ``(header, format spec)`` pairs (``"9.2f"``, ``"<14"``, ``">8"``): each value is formatted with its spec,
    each header padded to the spec's width (left-aligned where the spec starts with ``<``); one space
    between columns."""

    def head(title: str, spec: str) -> str:
        width = int(re.match(r"[<>]?(\d*)", spec).group(1) or 0)
        return f"{title:<{width}}" if spec.startswith("<") else f"{title:>{width}}"

    header = " ".join(head(title, spec) for title, spec in columns)
    lines = [header, "-" * len(header)]
    lines += [" ".join(f"{v:{spec}}" for v, (_, spec) in zip(row, columns, strict=True)) for row in rows]
    return lines
