"""Experiment command line (run from the repository root: ``experiments`` is not installed as a package).

Examples::

    python -m experiments.run fedavg --dataset digits --model mlp_100 --clients 10 --rounds 20
    python -m experiments.run --preset fedavg_fmnist_lenet5_iid --output results/fmnist
    python -m experiments.run --output results/fmnist --resume                # continue it
    python -m experiments.run --output results/fmnist --resume --rounds 200   # extend it
    python -m experiments.run --list-presets

Flags given on the command line override the preset's values, which override the algorithm's defaults
(:data:`experiments.algorithms.ALGORITHM_DEFAULTS`, used only without a preset), which override
:class:`ExperimentConfig`'s.

Rules for the results folder:

- a new run refuses an ``--output`` that already holds a run; ``--resume`` continues it, ``--overwrite``
  replaces it;
- ``--resume`` takes the configuration from the folder's ``config.json`` (a preset or flags given must
  agree with it) and fails before any work if there is no run there; ``--rounds N`` extends the run to N
  rounds without rewriting ``config.json`` (each resume is logged in ``resume_log.jsonl``), and without
  ``--rounds`` the last target is kept;
- Ctrl-C stops the run, prints the round of the last checkpoint and the command that continues it, and
  exits with status 130.

Exit status: 0 done, 2 bad input or folder, 3 stopped on NaN/inf, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

from experiments.algorithms import ALGORITHM_DEFAULTS, ALGORITHMS, OPTIMIZERS, default_config
from experiments.checkpoint import read_checkpoint_meta
from experiments.config import (
    ExperimentConfig,
    config_from_dict,
    field_docs,
    list_presets,
    load_preset,
    preset_description,
)
from experiments.driver import (
    InvalidStreamError,
    NonFiniteError,
    check_resumable_folder,
    run_config,
    run_experiment,
)
from sidejax.data import DATASETS, PARTITION_KINDS
from sidejax.models import MODELS


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


#: the fields with a fixed set of values (checked when the command line is parsed)
CHOICES: dict[str, tuple[str, ...]] = {
    "dataset": tuple(DATASETS),
    "model": tuple(MODELS),
    "client_optimizer": OPTIMIZERS,
    "server_optimizer": ("none", *OPTIMIZERS),
    "partition": tuple(PARTITION_KINDS),
    "client_strategy": ("auto", "map", "vmap"),
    "klms_trigger": ("thresholds", "rho"),
    "fedpm_estimator": ("fedpm", "ste"),
}

_GROUPS = {  # help sections, by field
    "data and federation": (
        "dataset model num_clients participation partition c_max alpha examples_per_client train_subset seed"
    ),
    "training": (
        "rounds local_epochs batch_size client_optimizer client_lr server_optimizer server_lr eval_every "
        "eval_batch_size client_strategy stop_at_accuracy"
    ),
    "KLMS (the *_klms algorithms)": (
        "log2_candidates klms_overhead_bits klms_adaptive block_size max_block_size klms_trigger "
        "klms_dbar_min klms_dbar_max"
    ),
    "method-specific": (
        "fedpm_estimator qsgd_levels sign_temperature sgld_step_size prior_weight_decay paper_compat"
    ),
}


def _flag(field: str) -> str:
    return "--" + ("clients" if field == "num_clients" else field).replace("_", "-")


def _default_help(field: str, base: Any) -> str:
    """``default X`` plus the algorithms whose CLI default differs (see ALGORITHM_DEFAULTS)."""
    by_value: dict[Any, list[str]] = {}
    for algo, values in ALGORITHM_DEFAULTS.items():
        if field in values and values[field] != base:
            by_value.setdefault(values[field], []).append(algo)
    text = f"default {base}"
    if by_value:
        text += "; " + "; ".join(f"{v} for {', '.join(algos)}" for v, algos in by_value.items())
    return text


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps help at spaces only (not inside ``re-partition`` or ``--list-presets``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.run",
        usage="python -m experiments.run [ALGORITHM] [--preset NAME] [--output DIR] [--resume | --overwrite] "
        "[--FIELD VALUE ...]",
        description=textwrap.fill(
            "Run a sidejax federated experiment and write a results folder (config.json, metrics.jsonl/.csv, "
            "summary.json, plots, checkpoint/). Run it from the repository root. Values come from, in order "
            "of precedence: the flags given, the --preset, the algorithm's defaults (shown per flag), "
            "ExperimentConfig's defaults; with --resume, the run's saved config.json replaces the last two. "
            "Ctrl-C stops a run and prints the command that resumes it.",
            width=100,
        ),
        epilog=(
            "examples:\n"
            "  python -m experiments.run signsgd --rounds 10                 # digits, MLP, tuned defaults\n"
            "  python -m experiments.run --preset demo_digits_qsgd_klms      # < 1 min on a CPU\n"
            "  python -m experiments.run --output results/x --resume --rounds 40   # continue / extend\n"
            "exit status: 0 done, 2 bad input or results folder, 3 stopped on NaN/inf, 130 interrupted"
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "algorithm",
        nargs="?",
        choices=sorted(ALGORITHMS),
        metavar="ALGORITHM",
        help=f"one of: {', '.join(sorted(ALGORITHMS))} (or take it from --preset)",
    )
    run = p.add_argument_group("run and results folder")
    run.add_argument(
        "--preset", metavar="NAME", help="named preset from experiments/presets (see --list-presets)"
    )
    run.add_argument("--list-presets", action="store_true", help="list the presets with their descriptions")
    run.add_argument(
        "--output",
        type=Path,
        metavar="DIR",
        help="results folder (default results/<preset>, or results/<algorithm>_<dataset>_<model>_s<seed>); "
        "refused if it already holds a run, unless --resume or --overwrite",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the output folder from its last checkpoint, with its saved config; "
        "--rounds N extends it to N rounds (config.json is kept; the extension goes to resume_log.jsonl)",
    )
    run.add_argument("--overwrite", action="store_true", help="replace a run already in the output folder")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--quiet", action="store_true", help="no per-round table")
    defaults = ExperimentConfig()
    docs = field_docs()
    groups = {}
    for title, names in _GROUPS.items():
        group = p.add_argument_group(title)
        for name in names.split():
            groups[name] = group
    for f in dataclasses.fields(ExperimentConfig):
        if f.name == "algorithm":
            continue
        base = getattr(defaults, f.name)
        kind = type(base)
        choices = CHOICES.get(f.name)
        text = docs[f.name].rstrip(".")
        if choices and not all(c in text for c in choices):
            text += f". choices: {', '.join(choices)}"
        groups[f.name].add_argument(
            _flag(f.name),
            dest=f.name,
            type=_parse_bool if kind is bool else str.lower if choices else kind,
            choices=choices,
            metavar="{true,false}" if kind is bool else "NAME" if choices else kind.__name__.upper(),
            default=None,
            help=f"{text} ({_default_help(f.name, base)})",
        )
    return p


def resolve(args: argparse.Namespace) -> tuple[ExperimentConfig, Path]:
    """The run's configuration and results folder from parsed arguments (see the module docstring).

    Raises:
      ValueError: bad or missing values.
      FileNotFoundError: ``--resume`` without a run in the results folder.
    """
    explicit = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ExperimentConfig)
        if f.name != "algorithm" and getattr(args, f.name, None) is not None
    }
    if args.algorithm:
        explicit["algorithm"] = args.algorithm
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --output, --overwrite replaces it: give one")
    if not args.preset and not args.algorithm and not (args.resume and args.output):
        raise ValueError("give an ALGORITHM or a --preset (see --help, --list-presets)")
    preset = load_preset(args.preset).to_dict() if args.preset else {}
    if args.preset:
        values = {**preset, **explicit}
        name = args.preset
    else:
        values = default_config(**explicit).to_dict() if args.algorithm else dict(explicit)
        if args.algorithm:
            name = f"{values['algorithm']}_{values['dataset']}_{values['model']}_s{values['seed']}"
    out = args.output or Path("results") / name
    if args.resume:
        # continue the saved run: its config.json is the base, the preset and the flags given must agree
        # with it (the driver checks), and the target rounds is --rounds if given, else the last target
        # recorded in the checkpoint
        check_resumable_folder(out)
        saved = run_config(json.loads((out / "config.json").read_text())).to_dict()
        values = {**saved, **preset, **explicit}
        if "rounds" not in explicit:
            values["rounds"] = read_checkpoint_meta(out / "checkpoint").get("rounds_target", saved["rounds"])
    return config_from_dict(values, source="command line"), out


def _resume_command(out: Path, rounds: int) -> str:
    """The command that continues the run in ``out`` (the interpreter as it was started)."""
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join(
        [str(exe), "-m", "experiments.run", "--output", str(out), "--resume", "--rounds", str(rounds)]
    )


def _interrupted(out: Path, rounds: int) -> int:
    """Ctrl-C: say where the run stopped and how to continue it; exit status 130 (128 + SIGINT)."""
    try:
        done = read_checkpoint_meta(out / "checkpoint")["round_index"]
    except (OSError, ValueError):
        done = None
    if done is None or not (out / "config.json").is_file():
        print(
            f"\ninterrupted before the first checkpoint of {out}: nothing to resume; run the same command "
            f"again with --overwrite",
            file=sys.stderr,
        )
    else:
        print(
            f"\ninterrupted: the last checkpoint in {out} is at round {done} of {rounds}. To continue:\n"
            f"    {_resume_command(out, rounds)}",
            file=sys.stderr,
        )
    return 130


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag (argparse has printed the usage and the error)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.list_presets:
        names = list_presets()
        width = max(map(len, names))
        for name in names:
            print(f"{name:<{width}}  {preset_description(name)}")
        return 0
    try:
        config, out = resolve(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_experiment(
            config,
            out,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            verbose=not args.quiet,
        )
    except KeyboardInterrupt:
        return _interrupted(out, config.rounds)
    except (NonFiniteError, InvalidStreamError) as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"done: {summary.rounds_run} rounds, final test accuracy {100 * summary.final_accuracy:.2f}%, "
        f"best {100 * summary.best_accuracy:.2f}%, {summary.total_bits:.4e} bits; results in {out}"
    )
    return 0


if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):  # `--list-presets | head` ends quietly, as other command-line tools do
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
