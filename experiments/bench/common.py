"""Shared parts of the benchmark scripts in :mod:`experiments.bench`: the command line from a table of flags
(with ``--quick`` / full defaults), the interleaved timing (wall and process CPU time, best or all of the
repeats), the benchmark's own subprocesses, the machine record and the JSON report writer."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple


def fill_defaults(args, quick: dict, full: dict) -> None:
    """Sets each flag of ``args`` left at ``None`` to its ``quick`` value (``args.quick``) or ``full`` one."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def machine_record(*, load_average: bool = False, **versions: str) -> dict:
    """The machine a benchmark ran on: JAX devices and backend, CPU counts, optionally the load average
    (read now, i.e. after the run), the platform, JAX's and numpy's versions, then ``versions`` (e.g.
    ``scipy_version=scipy.__version__``) in the order given."""
    import jax
    import numpy as np

    record = {
        "devices": [str(dev) for dev in jax.devices()],
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    if load_average:
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        record["load_average_after"] = list(load) if load else None
    record.update(platform=platform.platform(), jax_version=jax.__version__, numpy_version=np.__version__)
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


#: ``XLA_FLAGS`` that pin XLA's CPU backend to one thread (set before jax is imported)
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


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
