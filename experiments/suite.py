"""A paper's results table as data, and the one command that runs, resumes and tabulates every paper's suite.

Examples::

    python -m experiments.suite list                                  # the suites and their settings
    python -m experiments.suite cepam run results/cepam --setting fmnist_cnn_cpu
    python -m experiments.suite cepam run results/quick --setting fmnist_cnn_cpu --rounds 5 \\
        --only fl cepam_gauss_z1                                      # a short try (its own folder)
    python -m experiments.suite bpcfl run results/moons --setting moons --seeds 0 1 2
    python -m experiments.suite klms run results/klms --preset klms_fmnist_fedpm klms_fmnist_fedpm_klms
    python -m experiments.suite cepam resume results/cepam            # after Ctrl-C: the same plan again
    python -m experiments.suite cepam table results/cepam             # table.md / table.csv only
    python -m experiments.suite cepam plot results/cepam              # the figure only
    python -m experiments.suite cepam presets                         # rewrite experiments/presets/cepam_*

A :class:`Suite` declares a paper's **settings** (data, model, federation), its **variants** (the rows of the
paper's tables; preset ``<suite>_<setting>_<variant>`` is their combination), its **columns** (with their
number formats), how a run folder becomes a row (``label`` and ``cells``) and its **figure**. The per-paper
modules (:mod:`experiments.bicompfl`, :mod:`experiments.cepam`, :mod:`experiments.coreset_pfedbayes`,
:mod:`experiments.bpcfl`, :mod:`experiments.bpcfl_regression`, and the KLMS table :mod:`experiments.table`)
are such declarations; this module is everything they share.

``run DIR`` runs a plan into ``DIR/<preset>[_s<seed>]`` (one folder per run) and then writes the table and
the figure. The folder rule: ``DIR`` must be new or empty, or hold this suite's ``suite.json`` (written by
``run``: the suite and the arguments, which ``resume DIR`` replays); any other folder is refused unless
``--overwrite``. Inside it a run counts as done only for the configuration it was asked for: finished for
exactly that configuration it is skipped; interrupted, or finished with fewer rounds (a short try), it is
resumed from its checkpoint up to the rounds asked; of another configuration or of more rounds, the command
stops with status 2 before touching anything (``--force`` re-runs every run of the plan from scratch).
Ctrl-C stops with status 130 and prints the ``resume`` command.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Suite", "DriverRunner", "suite", "main", "alias", "run_configs", "write_presets", "table_rows"]

# --------------------------------------------------------------------------------------------------
# how runs are made and read: the driver's (every suite but the 1-D regression, which has its own runner)


def _parse_value(text: str) -> Any:
    """A ``--set`` value: JSON (``3``, ``0.1``, ``true``, ``[1, 2]``, ``"x"``) or else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class DriverRunner:
    """Runs an :class:`experiments.config.ExperimentConfig` with :func:`experiments.driver.run_experiment` and
    reads the run folders it writes (``config.json``, ``summary.json``, ``metrics.jsonl``)."""

    def load(self, name: str):
        from experiments.config import load_preset

        return load_preset(name)

    def with_rounds(self, config, rounds: int):
        if config.method.one_shot:  # a one-shot method keeps its 1 round
            return config
        return config.override({"run.rounds": rounds}, source="--rounds")

    def with_seed(self, config, seed: int):
        return config.override({"run.seed": seed}, source="--seeds")

    def with_value(self, config, key: str, text: str):
        return config.override({key: _parse_value(text)}, source="--set")

    def resolve(self, config, directory: Path, seed: int | None, source: str):
        """A relative ``run.init_from`` that is not a folder names another preset of the suite: it becomes
        that preset's run folder (of the same seed) in ``directory``, which must come earlier in the plan."""
        init = config.run.init_from
        if init and not Path(init).is_absolute() and not Path(init).exists():
            sibling = directory / (init if seed is None else f"{init}_s{seed}")
            config = config.override({"run.init_from": str(sibling)}, source=source)
        return config

    def plan(self, out: Path, config, force: bool) -> tuple[str, str]:
        """What to do with the run folder ``out`` for ``config``: ``("run", "")`` from scratch, ``("resume",
        why)`` (interrupted, or finished with fewer rounds than asked: extended), ``("skip", why)`` (finished
        for exactly this configuration), or ``("refuse", why)`` (another configuration, or more rounds)."""
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
        target = json.loads(summary.read_text()).get("rounds_target") if summary.is_file() else None
        target = meta.get("rounds_target") if not summary.is_file() else target
        asked = config.run.rounds
        if done > asked or (target is not None and target > asked):
            return "refuse", (
                f"{out} holds a run of {max(done, target or 0)} rounds and this asks for {asked}: its rows "
                "are not this table's; use --force to replace it, or another directory"
            )
        if summary.is_file() and target == asked:
            return "skip", f"finished run found in {out}, skipped (use --force to re-run)"
        if summary.is_file():
            return "resume", f"(extending the finished {target}-round run to {asked} rounds)"
        return "resume", "(resuming the interrupted run)"

    def execute(self, config, out: Path, *, resume: bool, label: str) -> None:
        from experiments import driver  # looked up at call time (tests replace run_experiment)

        driver.run_experiment(config, out, label=label, resume=resume, overwrite=not resume)

    def read(self, folder: Path) -> list[dict[str, Any]] | None:
        """``[{"config", "summary", "rows"}]`` of a finished run folder, ``[]`` for a folder without one;
        raises ``ValueError``/``KeyError``/``TypeError`` for one whose files cannot be read."""
        from experiments.driver import read_jsonl

        if not (folder / "summary.json").is_file() or not (folder / "config.json").is_file():
            return []
        config = json.loads((folder / "config.json").read_text())
        summary = json.loads((folder / "summary.json").read_text())
        return [{"config": config, "summary": summary, "rows": read_jsonl(folder / "metrics.jsonl")}]

    def preset_text(self, config, description: str) -> str:
        from experiments.config import preset_toml

        return preset_toml(config, description)


DRIVER = DriverRunner()

# --------------------------------------------------------------------------------------------------
# a suite as data


@dataclass(frozen=True)
class Suite:
    """A paper's results table as data.

    Attributes:
      name: the command's name for it and its presets' prefix (``<name>_<setting>_<variant>``).
      title: one line for ``--help`` and ``list``.
      columns: ``(column, format)`` in order, or the header ``"column | column:format | ..."``; ``format`` is
        a format spec for numbers (a cell over several seeds is ``mean ± sample std``), ``None`` (no
        ``:format``) for text (its distinct values joined with ", " over seeds). The first column is the
        row label.
      label: ``(folder name, config) -> row label`` of a run (a run whose label cannot be made is skipped
        with a warning).
      cells: ``(run, all runs) -> {column: value}`` for every column but the first; a run is
        ``{"name", "label", "config", "summary", "rows", "folder"}`` (plus ``annotate``'s keys).
      figure: ``(runs, directory) -> [paths written]``.
      settings: setting -> its description, or a tuple that starts with it (empty: named presets only).
      variants: variant -> its table label, or a tuple that starts with it, in the table's row order.
      config: ``(setting, variant) -> config`` (what ``presets`` writes and ``--setting`` loads).
      per_label: one row per label, over seeds (``True``), or one row per run.
      noun: what a variant is called in ``--help`` (``schemes``, ``methods``).
      preset_prefix: before the label in a preset's description.
      annotate: ``config -> extra keys`` of a run, computed when it is read (an error skips the run).
      runner: how runs are made and read (:class:`DriverRunner`, or the regression's).
    """

    name: str
    title: str
    columns: tuple[tuple[str, str | None], ...]
    label: Callable[[str, dict], str]
    cells: Callable[[dict, list[dict]], dict[str, Any]]
    figure: Callable[[list[dict], Path], list[Path]]
    settings: Mapping[str, str] = field(default_factory=dict)
    variants: Mapping[str, str] = field(default_factory=dict)
    config: Callable[[str, str], Any] | None = None
    per_label: bool = False
    noun: str = "variants"
    preset_prefix: str = ""
    annotate: Callable[[dict], dict] | None = None
    runner: Any = DRIVER

    def __post_init__(self):
        # the declarations' shorthands: columns as a header "name | name:spec | ...", and settings / variants
        # whose values are tuples that start with the description / label
        if isinstance(self.columns, str):
            columns = [c.strip().rpartition(":") for c in self.columns.split("|")]
            columns = tuple((name, spec) if sep else (spec, None) for name, sep, spec in columns)
            object.__setattr__(self, "columns", columns)
        for table in ("settings", "variants"):
            values = {k: v[0] if isinstance(v, tuple) else v for k, v in getattr(self, table).items()}
            object.__setattr__(self, table, values)

    @classmethod
    def of_module(cls, namespace: Mapping[str, Any], **fields: Any) -> Suite:
        """The suite of a paper's module ``experiments.<name>``, from its ``globals()``: the suite is named
        after the module, its settings and configs are the module's ``SETTINGS`` and ``suite_config``, its
        title is the module docstring's first paragraph (its lines joined); ``fields`` give the rest and may
        override any of these."""
        summary = namespace["__doc__"].split("\n\n")[0]
        declared = {
            "name": namespace["__spec__"].name.rpartition(".")[2],
            "title": " ".join(line.strip() for line in summary.splitlines()),
            "settings": namespace["SETTINGS"],
            "config": namespace["suite_config"],
        }
        return cls(**{**declared, **fields})

    def preset_name(self, setting: str, variant: str) -> str:
        return f"{self.name}_{setting}_{variant}"

    def check(self, setting: str, variant: str) -> None:
        """Raises ``ValueError`` naming an unknown setting or variant and listing the known ones."""
        if setting not in self.settings:
            raise ValueError(f"unknown setting {setting!r}; settings: {', '.join(self.settings)}")
        if variant not in self.variants:
            noun = self.noun.rstrip("s")
            raise ValueError(f"unknown {noun} {variant!r}; {self.noun}: {', '.join(self.variants)}")


#: every suite, by name (filled by :func:`suite` on first use)
SUITES: dict[str, Suite] = {}
_MODULES = ("table", "bicompfl", "cepam", "coreset_pfedbayes", "bpcfl", "bpcfl_regression")


def suite(name: str) -> Suite:
    """The suite called ``name`` (``ValueError`` listing the suites for an unknown one)."""
    if not SUITES:
        import importlib

        for module in _MODULES:
            s = importlib.import_module(f"experiments.{module}").SUITE
            SUITES.setdefault(s.name, s)
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(SUITES)}")
    return SUITES[name]


def write_presets(s: Suite, directory: Path | None = None) -> list[Path]:
    """Writes every (setting, variant) preset of ``s`` as canonical TOML; returns the paths."""
    from experiments.config import PRESET_DIR

    paths = []
    for setting, description in s.settings.items():
        for variant, label in s.variants.items():
            path = Path(directory or PRESET_DIR) / f"{s.preset_name(setting, variant)}.toml"
            text = f"{s.preset_prefix}{label}; {description}"
            path.write_text(s.runner.preset_text(s.config(setting, variant), text))
            paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------------
# reading run folders and making the table


def read_run_folders(directory: Path, runner=DRIVER) -> list[dict[str, Any]]:
    """Every finished run folder directly under ``directory`` (sorted by name) as records ``{"name",
    "folder", "config", "summary", "rows"}``; a folder whose files cannot be read is skipped with a warning
    naming it (on stderr), so one damaged run does not hide the others' table."""
    out = []
    for sub in sorted(p for p in Path(directory).iterdir() if p.is_dir()):
        try:
            records = runner.read(sub)
        except (ValueError, KeyError, TypeError) as e:
            print(f"warning: skipped {sub}: unreadable results ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        out += [{"name": sub.name, "folder": sub, **r} for r in records]
    return out


def collect(s: Suite, directory: Path) -> list[dict[str, Any]]:
    """The runs of ``directory`` with their labels (and ``annotate``'s keys), in the suite's row order (its
    variants' labels, then the others), then by folder name."""
    runs = []
    for r in read_run_folders(directory, s.runner):
        try:
            r["label"] = s.label(r["name"], r["config"])
            r.update(s.annotate(r["config"]) if s.annotate else {})
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            print(
                f"warning: skipped {r['folder']}: unreadable config ({type(e).__name__}: {e})",
                file=sys.stderr,
            )
            continue
        runs.append(r)
    order = list(s.variants.values())
    runs.sort(key=lambda r: (order.index(r["label"]) if r["label"] in order else len(order), r["name"]))
    return runs


def mean_std(values, spec: str) -> str:
    """``"mean ± sample std"`` of the non-``None`` ``values`` formatted with ``spec`` (one distinct value:
    itself; none: ``"-"``): a suite table's cell over seeds."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(set(vals)) == 1:  # one value, or the same on every seed (a preset's rate, say)
        return format(vals[0], spec)
    return f"{format(statistics.fmean(vals), spec)} ± {format(statistics.stdev(vals), spec)}"


def run_seed(config: dict) -> Any:
    """The seed of a run folder's ``config.json``: ``run.seed`` (or the top-level ``seed`` of an older, flat
    config)."""
    return config.get("run", config).get("seed")


def seed_cells(run: dict) -> dict[str, str]:
    """The ``seeds`` and ``runs`` cells of a run (its ``run.seed`` and folder name): the last two columns of a
    table with one row per label over seeds."""
    return {"seeds": str(run_seed(run["config"])), "runs": run["name"]}


def mean_curve(group: list[dict], points: Callable[[dict], list[tuple[float, float]]]):
    """The mean over the runs of ``group`` (one label's seeds) of their curves ``points(run)`` (``(x, y)``
    per evaluation), at each evaluation every run reached: ``(xs, ys)``."""
    curves = [points(r) for r in group]
    length = min(len(c) for c in curves)
    xs = [statistics.fmean(c[j][0] for c in curves) for j in range(length)]
    return xs, [statistics.fmean(c[j][1] for c in curves) for j in range(length)]


def mean_by_round(group: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The rounds every run of ``group`` evaluated ``key`` at, and the mean of ``key`` there (in %)."""
    curves = [dict(evaluated(r["rows"], key)) for r in group]
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return common, [100 * statistics.fmean(c[t] for c in curves) for t in common]


def by_label(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by their ``"label"`` (the table row), in order of appearance."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], []).append(r)
    return groups


def mean_of(rows, key):
    """The mean of ``key`` over the per-round rows that have it (``None``: none has it)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def evaluated(rows, key) -> list[tuple[int, float]]:
    """``(round, value)`` of the rows where ``key`` was evaluated."""
    return [(r["round"], r[key]) for r in rows if r.get(key) is not None]


def table_rows(s: Suite, runs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per run (or per label, over seeds, with ``per_label``), as strings in column order."""
    groups = by_label(runs) if s.per_label else {i: [r] for i, r in enumerate(runs)}
    out = []
    for group in groups.values():
        values = [s.cells(r, runs) for r in group]
        row = {s.columns[0][0]: group[0]["label"]}
        for column, spec in s.columns[1:]:
            got = [v[column] for v in values]
            # text over seeds: each distinct value once (a label's runs share their rounds, say)
            row[column] = ", ".join(dict.fromkeys(got)) if spec is None else mean_std(got, spec)
        out.append(row)
    return out


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


def draw_figure(path: Path, draw, *, xlabel: str, ylabel: str, title, xlog=False, wide=False) -> Path:
    """One figure: ``draw(ax)`` its curves, then the axes' labels, a log x axis (grid on minor ticks too),
    the title and the legend (``wide``: a larger figure with the legend beside the axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8) if wide else (7, 4.5))
    draw(ax, plt)
    if xlog:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, **({"fontsize": 10} if wide else {}))
    ax.grid(True, alpha=0.3, **({"which": "both"} if xlog else {}))
    ax.legend(
        **({"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if wide else {"fontsize": 8})
    )
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)
    return path


def single_figure(file: str, plot):
    """A suite's ``figure`` that writes one file, ``plot(runs, path, title="<dataset> / <model>")``."""

    def figure(runs, directory):
        data = runs[0]["config"]["data"]
        return [plot(runs, directory / file, title=f"{data['dataset']} / {data['model']}")]

    return figure


# --------------------------------------------------------------------------------------------------
# running a plan


def run_configs(directory: Path, runs, *, force: bool, resume_command: str, runner=DRIVER, start=None) -> int:
    """Runs each ``(name, config, label)`` into ``directory/name`` by the runner's plan (skip, resume,
    extend, refuse: the module docstring). Every run is planned first: a refused one stops the command with
    status 2 before anything runs (or ``start()``, called once the plan stands, writes anything). Returns 0,
    2, or 130 (Ctrl-C: ``resume_command`` printed)."""
    plans = [
        (name, config, label, *runner.plan(directory / name, config, force)) for name, config, label in runs
    ]
    for name, _, _, action, why in plans:
        if action == "refuse":
            print(f"{name}: {why}", file=sys.stderr)
            return 2
    if start:
        start()
    from experiments import interrupts

    current = [directory]

    def interrupted() -> int:
        print(
            f"\ninterrupted in {current[0]}; this resumes it from its last checkpoint (and skips finished "
            f"runs):\n    {resume_command}",
            file=sys.stderr,
        )
        return 130

    with interrupts.handle_ctrl_c(interrupted) as ctrl_c:
        for name, config, label, action, why in plans:
            if action == "skip":
                print(f"{name}: {why}")
                continue
            print(f"\n=== {name}" + (f" {why}" if why else ""))
            current[0] = directory / name
            try:
                runner.execute(config, directory / name, resume=action == "resume", label=label)
            except KeyboardInterrupt:  # stopped at a safe point (interrupts.stop_point), or no handler
                return ctrl_c.report() if ctrl_c else interrupted()
    return 0


def _plan(s: Suite, args) -> list[tuple[str, Any, str]]:
    """``[(run folder name, config, label)]`` of ``run``'s arguments (``ValueError`` for a bad one)."""
    runner = s.runner
    if args.preset:
        named = [(p, p) for p in args.preset]
    else:
        named = [(s.preset_name(args.setting, v), s.variants[v]) for v in args.only or list(s.variants)]
    runs = []
    for name, label in named:
        config = runner.load(name)
        for item in args.set or []:
            key, sep, text = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE")
            config = runner.with_value(config, key, text)
        config = runner.with_rounds(config, args.rounds) if args.rounds else config
        for seed in args.seeds or [None]:
            cfg = config if seed is None else runner.with_seed(config, seed)
            run_name = name if seed is None else f"{name}_s{seed}"
            runs.append((run_name, runner.resolve(cfg, args.directory, seed, name), label))
    return runs


def _check_folder(s: Suite, directory: Path, overwrite: bool) -> None:
    """The one-folder rule for ``run DIR`` (module docstring); raises with the reason."""
    from experiments.driver import check_new_output

    marker = directory / "suite.json"
    if marker.is_file():
        held = json.loads(marker.read_text()).get("suite")
        if held != s.name and not overwrite:
            raise ValueError(
                f"{directory} holds the {held!r} suite's runs, not {s.name!r}: choose another DIR"
            )
        return
    check_new_output(directory, overwrite=overwrite, flag="DIR")


def _run(s: Suite, args, argv: list[str]) -> int:
    if args.setting is None and not args.preset:
        choices = ", ".join(s.settings) or "(none: name presets)"
        raise ValueError(f"run needs --setting ({choices}) or --preset NAME ...")
    if args.setting is not None and args.preset:
        raise ValueError("give --setting or --preset, not both")
    if args.preset and args.only:
        raise ValueError("--only chooses among a setting's variants; with --preset, name the presets")
    if args.setting is not None and args.setting not in s.settings:
        raise ValueError(f"unknown setting {args.setting!r}; settings: {', '.join(s.settings)}")
    if args.rounds is not None and args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if args.seeds is not None and (min(args.seeds) < 0 or len(set(args.seeds)) != len(args.seeds)):
        raise ValueError("--seeds must be distinct integers >= 0")
    runs = _plan(s, args)  # every config is built (and checked) before anything is written
    _check_folder(s, args.directory, args.overwrite)

    def start():  # the plan stands: the folder and the arguments that `resume` replays
        args.directory.mkdir(parents=True, exist_ok=True)
        kept = [a for a in argv if a not in ("--force", "--overwrite")]
        (args.directory / "suite.json").write_text(
            json.dumps({"suite": s.name, "argv": kept}, indent=1) + "\n"
        )

    resume = f"python -m experiments.suite {s.name} resume {args.directory}"
    code = run_configs(
        args.directory, runs, force=args.force, resume_command=resume, runner=s.runner, start=start
    )
    return code or _tabulate(s, args.directory, table=True, figure=True)


def _tabulate(s: Suite, directory: Path, *, table: bool, figure: bool) -> int:
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    runs = collect(s, directory)
    if not runs:
        raise ValueError(f"no finished run folders of the {s.name!r} suite in {directory}")
    written = []
    if table:
        print(write_table(directory, table_rows(s, runs), [c for c, _ in s.columns]))
        written += [directory / "table.md", directory / "table.csv"]
    written += s.figure(runs, directory) if figure else []
    print("written: " + ", ".join(str(p) for p in written))
    return 0


# --------------------------------------------------------------------------------------------------
# the command line


def _parser(s: Suite) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m experiments.suite {s.name}", description=s.title)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run a setting's presets (or named ones), then write the table and figure"
    )
    run.add_argument("directory", type=Path, help="the suite's folder: one sub-folder per run")
    run.add_argument("--setting", choices=list(s.settings) or None, help="run this setting's presets")
    run.add_argument(
        "--only", nargs="+", choices=list(s.variants), help=f"only these {s.noun} (default: all)"
    )
    run.add_argument("--preset", nargs="+", metavar="NAME", help="run these presets (instead of --setting)")
    run.add_argument("--rounds", type=int, default=None, help="override the presets' number of rounds")
    run.add_argument(
        "--seeds", nargs="+", type=int, default=None, metavar="SEED",
        help="run every preset once per seed, into <preset>_s<seed> (default: the presets' seed, once)",
    )  # fmt: skip
    run.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="change a field of every run's config"
    )
    run.add_argument("--force", action="store_true", help="re-run the plan's runs from scratch")
    run.add_argument("--overwrite", action="store_true", help="write into a non-empty folder of no suite")
    for command, text in (
        ("resume", "run the plan that `run` last ran in DIR again: resume interrupted runs, skip finished"),
        ("table", "write table.md and table.csv from the finished runs in DIR"),
        ("plot", "write the figure from the finished runs in DIR"),
    ):
        sub.add_parser(command, help=text).add_argument("directory", type=Path, help="the suite's folder")
    sub.add_parser(
        "presets", help=f"rewrite experiments/presets/{s.name}_*.toml from the suite's definitions"
    )
    return parser


def _resume(s: Suite, directory: Path) -> int:
    marker = directory / "suite.json"
    if not marker.is_file():
        raise ValueError(f"no suite run to resume in {directory} (no suite.json): start it with `run`")
    saved = json.loads(marker.read_text())
    if saved.get("suite") != s.name:
        raise ValueError(f"{directory} holds the {saved.get('suite')!r} suite's runs, not {s.name!r}")
    command, _, *flags = saved[
        "argv"
    ]  # the folder as given now (the saved one may be relative to another cwd)
    return main([s.name, command, str(directory), *flags])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        suite("klms")  # fills the registry
        print("python -m experiments.suite SUITE {run,resume,table,plot,presets} ...; suites:")
        for s in SUITES.values():
            print(f"  {s.name}: {s.title}" + (f" (settings: {', '.join(s.settings)})" if s.settings else ""))
        return 0
    try:
        s = suite(argv[0])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = _parser(s).parse_args(argv[1:])
    try:
        if args.command == "presets":
            if not s.settings:
                raise ValueError(f"the {s.name!r} suite has no generated presets")
            print("\n".join(str(p) for p in write_presets(s)))
            return 0
        if args.command == "run":
            return _run(s, args, argv[1:])
        if args.command == "resume":
            return _resume(s, args.directory)
        return _tabulate(s, args.directory, table=args.command == "table", figure=args.command == "plot")
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def alias(name: str) -> None:
    """``python -m experiments.<paper> ARGS`` is ``python -m experiments.suite <paper> ARGS``."""
    from experiments.interrupts import exit_process

    exit_process(main([name, *sys.argv[1:]]))


if __name__ == "__main__":
    from experiments.interrupts import exit_process

    exit_process(main())
