"""Experiment command line.

Examples::

    python -m experiments.run fedavg --dataset digits --model mlp_100 --clients 10 --rounds 20
    python -m experiments.run --preset fedavg_fmnist_lenet5_iid --output results/fmnist
    python -m experiments.run --preset fedavg_fmnist_lenet5_iid --output results/fmnist --resume
    python -m experiments.run --list-presets

Flags given on the command line override the preset's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from experiments.algorithms import ALGORITHMS
from experiments.config import ExperimentConfig, config_from_dict, list_presets, load_preset
from experiments.driver import NonFiniteError, run_experiment


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.run",
        description="Run a sidejax federated experiment and write a results folder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("algorithm", nargs="?", help=f"one of {sorted(ALGORITHMS)} (or take it from --preset)")
    p.add_argument("--preset", help="named preset from experiments/presets (see --list-presets)")
    p.add_argument("--list-presets", action="store_true", help="list presets and exit")
    p.add_argument("--output", type=Path, help="results folder (default: results/<preset or run name>)")
    p.add_argument("--resume", action="store_true", help="continue from the output folder's last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no per-round table")
    defaults = ExperimentConfig()
    for f in dataclasses.fields(ExperimentConfig):
        if f.name == "algorithm":
            continue
        flag = "--" + ("clients" if f.name == "num_clients" else f.name).replace("_", "-")
        kind = type(getattr(defaults, f.name))
        p.add_argument(
            flag,
            dest=f.name,
            type=_parse_bool if kind is bool else kind,
            default=None,
            help=f"(config field {f.name}; default {getattr(defaults, f.name)!r})",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_presets:
        for name in list_presets():
            print(name)
        return 0
    values = load_preset(args.preset).to_dict() if args.preset else {}
    for f in dataclasses.fields(ExperimentConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name != "algorithm":
            values[f.name] = v
    if args.algorithm:
        values["algorithm"] = args.algorithm
    if not args.preset and not args.algorithm:
        print("error: give an ALGORITHM or a --preset (see --help, --list-presets)", file=sys.stderr)
        return 2
    try:
        config = config_from_dict(values, source="command line")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.preset or f"{config.algorithm}_{config.dataset}_{config.model}_s{config.seed}"
    out = args.output or Path("results") / name
    try:
        summary = run_experiment(
            config, out, resume=args.resume, progress=not args.no_progress, verbose=not args.quiet
        )
    except NonFiniteError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"done: {summary.rounds_run} rounds, final test accuracy {100 * summary.final_accuracy:.2f}%, "
        f"best {100 * summary.best_accuracy:.2f}%, {summary.total_bits:.4e} bits; results in {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
