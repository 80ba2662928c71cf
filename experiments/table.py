"""Results tables: accuracy, average bits per parameter and compression factors of finished runs.

Examples::

    # run the reduced-scale KLMS presets (skipping finished ones), then write the table
    python -m experiments.table results/klms_fmnist --run klms_fmnist_fedpm klms_fmnist_fedpm_klms
    # just tabulate every run folder under a directory
    python -m experiments.table results/klms_fmnist

A run folder is any directory with ``summary.json`` and ``config.json`` (written by
:func:`experiments.driver.run_experiment`). The table is written as ``table.md`` and ``table.csv`` in the
directory and printed, and the runs of each dataset and model are plotted together in
``plots/<dataset>_<model>/`` (accuracy against round, total bits and uplink bits). Columns:

- ``last-5 mean acc``: mean test accuracy of the last five evaluations (less noisy than the final one
  for methods that evaluate a sampled network, such as FedPM);
- ``uplink bpp``: mean over rounds and participants of the uplink message length (bits) / parameters;
- ``x vs 32-bit``: ``32 / uplink bpp``;
- ``x vs host``: the host method's uplink bpp / this run's, for a KLMS run whose host (e.g. ``fedpm`` for
  ``fedpm_klms``) is in the same table with the same dataset and model;
- ``ideal bpp``: the coder's mean ideal rate / parameters (``info.ideal_bits``), a bound, not a code length:
  :math:`\\sum_j D_{KL}(q_j\\|p_j)` for KLMS, the two-part enumerative length for FedPM's Golomb-coded
  masks, none for the other baselines.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from experiments.algorithms import KLMS_HOSTS
from experiments.driver import plot_runs, read_jsonl, tail_accuracy

__all__ = [
    "collect_runs",
    "read_run_folders",
    "run_identity",
    "results_table",
    "comparison_plots",
    "markdown_table",
    "write_table",
    "run_configs",
    "run_presets",
    "tabulate",
    "suite_main",
    "main",
]

COLUMNS = (
    "run",
    "algorithm",
    "dataset",
    "model",
    "rounds",
    "final acc (%)",
    "best acc (%)",
    "last-5 mean acc (%)",
    "uplink bpp",
    "x vs 32-bit",
    "x vs host",
    "ideal bpp",
)


def collect_runs(directory: Path) -> list[dict[str, Any]]:
    """Reads every run folder directly under ``directory`` (sorted by name)."""
    runs = []
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()):
        if not (sub / "summary.json").is_file() or not (sub / "config.json").is_file():
            continue
        summary = json.loads((sub / "summary.json").read_text())
        if "tail_accuracy" not in summary and (sub / "metrics.jsonl").is_file():
            # folders written before the driver recorded it: recompute from the per-round log
            rows = read_jsonl(sub / "metrics.jsonl")
            summary["tail_accuracy"] = tail_accuracy(
                [r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None]
            )
        runs.append(
            {"name": sub.name, "summary": summary, "config": json.loads((sub / "config.json").read_text())}
        )
    return runs


def read_run_folders(
    directory: Path,
) -> list[tuple[Path, dict[str, Any], dict[str, Any], list[dict[str, Any]]]]:
    """Every finished run folder directly under ``directory`` (sorted by name) as ``(folder, config, summary,
    per-round rows)``; a folder whose files cannot be read is skipped with a warning naming it (on stderr),
    not fatal, so one damaged run does not hide the others' table."""
    out = []
    for sub in sorted(p for p in Path(directory).iterdir() if p.is_dir()):
        if not (sub / "summary.json").is_file() or not (sub / "config.json").is_file():
            continue
        try:
            config = json.loads((sub / "config.json").read_text())
            summary = json.loads((sub / "summary.json").read_text())
            rows = read_jsonl(sub / "metrics.jsonl") if (sub / "metrics.jsonl").is_file() else []
            config["method"]["name"], config["coder"]["name"]  # noqa: B018 (every table's row label needs them)
        except (ValueError, KeyError, TypeError) as e:
            print(f"warning: skipped {sub}: unreadable results ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        out.append((sub, config, summary, rows))
    return out


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run_identity(config: dict[str, Any]) -> tuple[str, str, str]:
    """``(algorithm, dataset, model)`` of a run folder's ``config.json``: the sectioned one (``algorithm``
    and the ``data`` table), or a flat one written by an older version (read-only here: tables of old
    results keep working)."""
    data = config.get("data", config)
    return config["algorithm"], data["dataset"], data["model"]


def results_table(runs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per run, as strings, in :data:`COLUMNS` order."""
    host_bpp = {}
    for r in runs:
        host_bpp[run_identity(r["config"])] = r["summary"]["mean_uplink_bpp"]
    rows = []
    for r in runs:
        (algorithm, dataset, model), s = run_identity(r["config"]), r["summary"]
        bpp = s["mean_uplink_bpp"]
        host = KLMS_HOSTS.get(algorithm)
        hb = host_bpp.get((host, dataset, model)) if host else None
        rows.append(
            {
                "run": r["name"],
                "algorithm": algorithm,
                "dataset": dataset,
                "model": model,
                "rounds": str(s["rounds_run"]),
                "final acc (%)": _fmt(100 * s["final_accuracy"], ".2f"),
                "best acc (%)": _fmt(100 * s["best_accuracy"], ".2f"),
                "last-5 mean acc (%)": _fmt(_pct(s.get("tail_accuracy")), ".2f"),
                "uplink bpp": _fmt(bpp, ".4f"),
                "x vs 32-bit": _fmt(32 / bpp if bpp else None, ".0f"),
                "x vs host": _fmt(hb / bpp if (hb and bpp) else None, ".1f"),
                "ideal bpp": _fmt(s.get("mean_ideal_bpp"), ".4f"),
            }
        )
    return rows


def comparison_plots(directory: Path, runs: list[dict[str, Any]]) -> list[Path]:
    """Side-by-side accuracy plots (:data:`experiments.driver.PLOT_FILES`: against round, total bits and
    uplink bits) of the runs that share a dataset and model, in ``directory/plots/<dataset>_<model>/``."""
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        rows = read_jsonl(directory / r["name"] / "metrics.jsonl")
        if rows:
            _, dataset, model = run_identity(r["config"])
            groups.setdefault((dataset, model), {})[r["name"]] = rows
    paths = []
    for (dataset, model), group in groups.items():
        out = directory / "plots" / f"{dataset}_{model}"
        out.mkdir(parents=True, exist_ok=True)
        paths += plot_runs(group, out, title=f"{dataset} / {model}")
    return paths


def markdown_table(rows: list[dict[str, str]], columns) -> str:
    """``rows`` as a Markdown table with the given column order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_table(directory: Path, rows: list[dict[str, str]], columns) -> str:
    """Writes ``table.md`` and ``table.csv`` into ``directory``; returns the Markdown."""
    md = markdown_table(rows, columns)
    (directory / "table.md").write_text(md)
    with (directory / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    return md


def _planned(out: Path, config, force: bool) -> tuple[str, str]:
    """What to do with the run folder ``out`` for ``config``: ``("run", "")`` from scratch, ``("resume",
    why)`` (interrupted, or finished with fewer rounds than asked: extended), ``("skip", why)`` (finished for
    exactly this configuration), or ``("refuse", why)`` (a run of another configuration, or of more rounds,
    which this command will not overwrite)."""
    from experiments.checkpoint import checkpoint_exists, read_checkpoint_meta
    from experiments.driver import is_run_folder, same_run_config

    if force or not is_run_folder(out):
        return "run", ""
    if not ((out / "config.json").is_file() and checkpoint_exists(out / "checkpoint")):
        return "run", ""  # started but never checkpointed: nothing to keep
    try:
        same_run_config(out, config)
    except ValueError as e:
        return "refuse", f"{e}; use --force to replace it, or another directory"
    summary = out / "summary.json"
    meta = read_checkpoint_meta(out / "checkpoint")
    done = meta["round_index"]
    target = (
        json.loads(summary.read_text()).get("rounds_target")
        if summary.is_file()
        else meta.get("rounds_target")
    )
    asked = config.run.rounds
    if done > asked or (target is not None and target > asked):
        held = max(done, target or 0)
        return "refuse", (
            f"{out} holds a run of {held} rounds and this asks for {asked}: its rows are not this table's; "
            "use --force to replace it, or another directory"
        )
    if summary.is_file() and target == asked:
        return "skip", f"finished run found in {out}, skipped (use --force to re-run)"
    if summary.is_file():
        return "resume", f"(extending the finished {target}-round run to {asked} rounds)"
    return "resume", "(resuming the interrupted run)"


def run_configs(directory: Path, runs, *, force: bool, resume_command: str) -> int:
    """Runs each ``(name, config, label)`` into ``directory/name``. A run already there counts only for the
    configuration it was asked for: finished for exactly ``config``, it is skipped; interrupted, or finished
    with fewer rounds (a short try), it is resumed up to ``config.run.rounds``; of another configuration or
    more rounds, the command stops with status 2 before touching it. ``force`` re-runs everything from
    scratch. Ctrl-C stops it, prints ``resume_command`` (which resumes it and skips finished runs) and
    returns 130; otherwise 0. Shared by the table commands (:mod:`experiments.bicompfl`)."""
    from experiments.driver import run_experiment

    for name, config, label in runs:
        out = directory / name
        action, why = _planned(out, config, force)
        if action == "skip":
            print(f"{name}: {why}")
            continue
        if action == "refuse":
            print(f"{name}: {why}", file=sys.stderr)
            return 2
        resume = action == "resume"
        print(f"\n=== {name}" + (f" {why}" if resume else ""))
        try:
            run_experiment(config, out, label=label, resume=resume, overwrite=not resume)
        except KeyboardInterrupt:
            print(
                f"\ninterrupted in {out}; this resumes it from its last checkpoint (and skips finished "
                f"runs):\n    {resume_command}",
                file=sys.stderr,
            )
            return 130
    return 0


def mean_std(values, spec: str) -> str:
    """``"mean ± sample std"`` of the non-``None`` ``values`` formatted with ``spec`` (one value: itself;
    none: ``"-"``): a suite table's cell over seeds."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return format(vals[0], spec)
    return f"{format(statistics.fmean(vals), spec)} ± {format(statistics.stdev(vals), spec)}"


def by_label(runs: list[dict]) -> dict[str, list[dict]]:
    """A suite's collected runs grouped by their ``"label"`` (the table row), in order of appearance."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], []).append(r)
    return groups


def run_presets(
    directory: Path, presets, *, load, rounds, force: bool, resume_command: str, seeds=None
) -> int:
    """:func:`run_configs` of named presets: ``presets`` is ``[(preset name, label)]``, each loaded with
    ``load(name)`` and its ``run.rounds`` replaced by ``rounds`` if given (not for a one-shot method). With
    ``seeds`` (a list of ints) every preset runs once per seed, into ``<preset>_s<seed>`` (``run.seed``
    replaced). A relative ``run.init_from`` that is not a folder names another preset of the suite: it
    becomes that preset's run folder (of the same seed) in ``directory``, which must come earlier in
    ``presets``."""
    runs = []
    for name, label in presets:
        config = load(name)
        if rounds and not getattr(config.method, "one_shot", False):  # a one-shot method keeps its 1 round
            config = config.override({"run.rounds": rounds}, source="--rounds")
        for seed in seeds or [None]:
            run_name, cfg = name, config
            if seed is not None:
                run_name, cfg = f"{name}_s{seed}", config.override({"run.seed": seed}, source="--seeds")
            source = cfg.run.init_from
            if source and not Path(source).is_absolute() and not Path(source).exists():
                # a suite's warm start names a sibling preset: its run folder of the same seed here
                sibling = directory / (source if seed is None else f"{source}_s{seed}")
                cfg = cfg.override({"run.init_from": str(sibling)}, source=name)
            runs.append((run_name, cfg, label))
    return run_configs(directory, runs, force=force, resume_command=resume_command)


def tabulate(directory: Path, collect, table_rows, columns, plot, figure_name: str) -> int:
    """The end of a suite's ``table`` command: ``collect(directory)`` the finished runs, write
    ``table.md`` / ``table.csv`` (:func:`write_table`) and ``plot(runs, directory / figure_name, title=...)``,
    print them; exit status 2, with the reason, when there is no directory or no finished run in it."""
    if not directory.is_dir():
        print(f"error: {directory} is not a directory", file=sys.stderr)
        return 2
    runs = collect(directory)
    if not runs:
        print(
            f"error: no finished run folders (summary.json and config.json) in {directory}", file=sys.stderr
        )
        return 2
    md = write_table(directory, table_rows(runs), columns)
    data = runs[0]["config"]["data"]
    figure = plot(runs, directory / figure_name, title=f"{data['dataset']} / {data['model']}")
    print(md)
    print(f"written: {directory / 'table.md'}, {directory / 'table.csv'}, {figure}")
    return 0


def suite_main(
    argv,
    *,
    module: str,
    description: str,
    settings,
    variants,
    noun: str,
    preset_name,
    write_presets,
    load,
    collect,
    table_rows,
    columns,
    plot,
    figure_name: str,
) -> int:
    """The command line of a paper's experiment suite (``python -m experiments.<module>``):

    - ``table DIR [--setting S] [--only V ...] [--rounds N] [--seeds K ...] [--force]``: run the setting's
      presets (:func:`run_presets`: skip finished, resume interrupted; with ``--seeds`` once per seed) and
      write the table and the plot (:func:`tabulate`);
    - ``presets``: rewrite the suite's preset files (``write_presets()``).

    ``variants`` maps each variant (scheme) name to its table label; ``load(name)`` loads a preset."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{module}", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    p_table = sub.add_parser("table", help="run a setting's presets (optional) and write the table and plot")
    p_table.add_argument("directory", type=Path, help="folder holding one sub-folder per run")
    p_table.add_argument("--setting", choices=list(settings), help="run this setting's presets first")
    p_table.add_argument(
        "--only", nargs="*", choices=list(variants), help=f"only these {noun} (default: all)"
    )
    p_table.add_argument("--rounds", type=int, default=None, help="override the presets' number of rounds")
    p_table.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        metavar="SEED",
        help="run every preset once per seed, into <preset>_s<seed> (default: the presets' seed, once)",
    )
    p_table.add_argument(
        "--force",
        action="store_true",
        help="re-run from scratch (default: skip finished, resume interrupted)",
    )
    sub.add_parser(
        "presets", help=f"rewrite experiments/presets/{module}_*.toml from the suite's definitions"
    )
    args = parser.parse_args(argv)
    if args.command == "presets":
        for path in write_presets():
            print(path)
        return 0
    if args.rounds is not None and args.rounds < 1:
        print("error: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.seeds is not None and (min(args.seeds) < 0 or len(set(args.seeds)) != len(args.seeds)):
        print("error: --seeds must be distinct integers >= 0", file=sys.stderr)
        return 2
    if args.setting:
        presets = [(preset_name(args.setting, v), variants[v]) for v in args.only or list(variants)]
        given = [a for a in argv if a != "--force"]
        code = run_presets(
            args.directory,
            presets,
            load=load,
            rounds=args.rounds,
            force=args.force,
            resume_command=f"python -m experiments.{module} {shlex.join(given)}",
            seeds=args.seeds,
        )
        if code:
            return code
    return tabulate(args.directory, collect, table_rows, columns, plot, figure_name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.table", description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="folder holding one sub-folder per run")
    parser.add_argument("--run", nargs="*", default=[], metavar="PRESET", help="run these presets first")
    parser.add_argument(
        "--force",
        action="store_true",
        help="re-run presets from scratch (default: skip finished, resume interrupted)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="override the presets' number of rounds")
    args = parser.parse_args(argv)

    if args.run:
        from experiments.config import load_preset

        runs = []
        for preset in args.run:
            config = load_preset(preset)
            if args.rounds:
                config = config.override({"run.rounds": args.rounds}, source="--rounds")
            runs.append((preset, config, preset))
        given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--force"]
        code = run_configs(
            args.directory,
            runs,
            force=args.force,
            resume_command=f"python -m experiments.table {shlex.join(given)}",
        )
        if code:
            return code
    if not args.directory.is_dir():
        print(f"error: {args.directory} is not a directory", file=sys.stderr)
        return 2
    runs = collect_runs(args.directory)
    if not runs:
        print(
            f"error: no run folders (with summary.json and config.json) in {args.directory}", file=sys.stderr
        )
        return 2
    md = write_table(args.directory, results_table(runs), COLUMNS)
    print(md)
    print(f"written: {args.directory / 'table.md'}, {args.directory / 'table.csv'}")
    for path in comparison_plots(args.directory, runs):
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
