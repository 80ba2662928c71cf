"""The KLMS results table (docs/papers/klms.md): accuracy, average bits per parameter and compression factors
of finished runs, one row per preset (mean ± std over its seeds' run folders), as a
:class:`experiments.suite.Suite` (``klms``).

Examples::

    # run the reduced-scale KLMS presets (skipping finished ones), then write the table and the plots
    python -m experiments.suite klms run results/klms_fmnist --preset klms_fmnist_fedpm klms_fmnist_fedpm_klms
    # just tabulate (or plot) every run folder under a directory
    python -m experiments.suite klms table results/klms_fmnist
    python -m experiments.suite klms plot results/klms_fmnist

A run folder is any directory with ``summary.json`` and ``config.json`` (written by
:func:`experiments.driver.run_experiment`). The table is ``table.md`` and ``table.csv`` in the directory,
and the runs of each dataset and model are plotted together in ``plots/<dataset>_<model>/`` (accuracy
against round, total bits and uplink bits). Columns:

- ``last-5 mean acc``: mean test accuracy of the last five evaluations (less noisy than the final one
  for methods that evaluate a sampled network, such as FedPM);
- ``uplink bpp``: mean over rounds and participants of the uplink message length (bits) / parameters;
- ``x vs 32-bit``: ``32 / uplink bpp``;
- ``x vs host``: the host method's uplink bpp / this run's, for a KLMS run whose host (e.g. ``fedpm`` for
  ``fedpm_klms``) is in the same table with the same dataset, model and seed;
- ``ideal bpp``: the coder's mean ideal rate / parameters (``info.ideal_bits``), a bound, not a code length:
  :math:`\\sum_j D_{KL}(q_j\\|p_j)` for KLMS, the two-part enumerative length for FedPM's Golomb-coded
  masks, none for the other baselines.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from experiments.algorithms import KLMS_HOSTS
from experiments.driver import plot_runs, tail_accuracy
from experiments.suite import Suite, run_seed, seed_cells

__all__ = ["SUITE", "run_identity"]


def run_identity(config: dict[str, Any]) -> tuple[str, str, str]:
    """``(algorithm, dataset, model)`` of a run folder's ``config.json``: the sectioned one (``algorithm``
    and the ``data`` table), or a flat one written by an older version (read-only here: tables of old
    results keep working)."""
    data = config.get("data", config)
    return config["algorithm"], data["dataset"], data["model"]


def _tail(run) -> float | None:
    """The summary's last-5 mean accuracy, recomputed from the per-round log for folders written before the
    driver recorded it."""
    if "tail_accuracy" in run["summary"] or not run["rows"]:
        return run["summary"].get("tail_accuracy")
    return tail_accuracy([r["test_accuracy"] for r in run["rows"] if r.get("test_accuracy") is not None])


def _cells(run, runs) -> dict[str, Any]:
    (algorithm, dataset, model), s = run_identity(run["config"]), run["summary"]
    # the host run of the same dataset, model and seed
    host_bpp = {
        (*run_identity(r["config"]), run_seed(r["config"])): r["summary"]["mean_uplink_bpp"] for r in runs
    }
    bpp = s["mean_uplink_bpp"]
    host = KLMS_HOSTS.get(algorithm)
    hb = host_bpp.get((host, dataset, model, run_seed(run["config"]))) if host else None
    tail = _tail(run)
    return {
        "algorithm": algorithm,
        "dataset": dataset,
        "model": model,
        "rounds": str(s["rounds_run"]),
        "final acc (%)": 100 * s["final_accuracy"],
        "best acc (%)": 100 * s["best_accuracy"],
        "last-5 mean acc (%)": None if tail is None else 100 * tail,
        "uplink bpp": bpp,
        "x vs 32-bit": 32 / bpp if bpp else None,
        "x vs host": hb / bpp if (hb and bpp) else None,
        "ideal bpp": s.get("mean_ideal_bpp"),
        **seed_cells(run),
    }


def comparison_plots(runs: list[dict[str, Any]], directory: Path) -> list[Path]:
    """Side-by-side accuracy plots (:data:`experiments.driver.PLOT_FILES`: against round, total bits and
    uplink bits) of the runs that share a dataset and model, in ``directory/plots/<dataset>_<model>/``."""
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        if r["rows"]:
            _, dataset, model = run_identity(r["config"])
            groups.setdefault((dataset, model), {})[r["name"]] = r["rows"]
    paths = []
    for (dataset, model), group in groups.items():
        out = directory / "plots" / f"{dataset}_{model}"
        out.mkdir(parents=True, exist_ok=True)
        paths += plot_runs(group, out, title=f"{dataset} / {model}")
    return paths


SUITE = Suite(
    name="klms",
    title=(
        "KLMS and its hosts: accuracy, bits per parameter and compression factors, one row per preset (mean "
        "± std over its seeds)"
    ),
    columns=(
        "preset | algorithm | dataset | model | rounds | final acc (%):.2f | best acc (%):.2f | "
        "last-5 mean acc (%):.2f | uplink bpp:.4f | x vs 32-bit:.0f | x vs host:.1f | "
        "ideal bpp:.4f | seeds | runs"
    ),
    # a run's preset: its folder's name without the ``_s<seed>`` that ``--seeds`` appends
    label=lambda name, config: re.sub(r"_s\d+$", "", name),
    per_label=True,
    cells=_cells,
    figure=comparison_plots,
)

if __name__ == "__main__":  # the old command, an alias of: python -m experiments.suite klms ...
    from experiments.suite import alias

    alias("klms")
