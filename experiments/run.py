"""Experiment command line (run from the repository root: ``experiments`` is not installed as a package).

Examples::

    python -m experiments.run fedavg --dataset digits --model mlp_100 --clients 10 --rounds 20
    python -m experiments.run --preset fedavg_fmnist_lenet5_iid --output results/fmnist
    python -m experiments.run --output results/fmnist --resume                # continue it
    python -m experiments.run --output results/fmnist --resume --rounds 200   # extend it
    python -m experiments.run --list-presets

Flags given on the command line override the preset's values.

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
import sys
from pathlib import Path

from experiments.algorithms import ALGORITHMS
from experiments.checkpoint import read_checkpoint_meta
from experiments.config import ExperimentConfig, config_from_dict, list_presets, load_preset
from experiments.driver import InvalidStreamError, NonFiniteError, run_config, run_experiment


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
    p.add_argument("--overwrite", action="store_true", help="replace a run already in the output folder")
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
    args = build_parser().parse_args(argv)
    if args.list_presets:
        for name in list_presets():
            print(name)
        return 0
    explicit = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ExperimentConfig)
        if f.name != "algorithm" and getattr(args, f.name, None) is not None
    }
    if args.algorithm:
        explicit["algorithm"] = args.algorithm
    if args.resume and args.overwrite:
        print(
            "error: --resume continues the run in --output, --overwrite replaces it: give one",
            file=sys.stderr,
        )
        return 2
    if not args.preset and not args.algorithm and not (args.resume and args.output):
        print("error: give an ALGORITHM or a --preset (see --help, --list-presets)", file=sys.stderr)
        return 2
    try:
        preset = load_preset(args.preset).to_dict() if args.preset else {}
        values = {**preset, **explicit}
        if args.preset:
            name = args.preset
        else:
            named = config_from_dict(values, source="command line")
            name = f"{named.algorithm}_{named.dataset}_{named.model}_s{named.seed}"
        out = args.output or Path("results") / name
        if args.resume:
            # continue the saved run: its config.json is the base, the preset and the flags given must
            # agree with it (the driver checks), and the target rounds is --rounds if given, else the last
            # target recorded in the checkpoint
            if not (out / "config.json").is_file():
                raise FileNotFoundError(
                    f"--resume: no run to resume in {out} (no config.json there); start it without --resume"
                )
            saved = run_config(json.loads((out / "config.json").read_text())).to_dict()
            values = {**saved, **preset, **explicit}
            if "rounds" not in explicit:
                values["rounds"] = read_checkpoint_meta(out / "checkpoint").get(
                    "rounds_target", saved["rounds"]
                )
        config = config_from_dict(values, source="command line")
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
    sys.exit(main())
