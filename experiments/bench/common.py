"""Shared parts of the benchmark scripts in :mod:`experiments.bench`: the machine record, the JSON report
writer, and the ``--quick`` / full defaults of optional flags. None of this runs inside a timed region."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


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
