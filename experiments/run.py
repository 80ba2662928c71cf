"""Experiment command line (run from the repository root: ``experiments`` is not installed as a package).

Examples::

    python -m experiments.run fedavg --data.num_clients 10 --run.rounds 20 --method.client_lr 0.1
    python -m experiments.run fedpm_klms --coder.log2_num_candidates 6 --run.rounds 5
    python -m experiments.run --method.name sgld --coder.name float32          # a pair without a shortcut
    python -m experiments.run --preset fedavg_fmnist_lenet5_iid --output results/fmnist
    python -m experiments.run --output results/fmnist --resume                    # continue it
    python -m experiments.run --output results/fmnist --resume --run.rounds 200   # extend it
    python -m experiments.run --list-presets

A flag ``--<table>.<field>`` sets a field of the config's ``[run]``, ``[data]``, ``[method]`` or ``[coder]``
table (:mod:`experiments.config`); ``none`` unsets an optional field. Flags override the preset's values;
without a preset, the defaults of the method (its tuned values) and of its coder as tuned for it
(:func:`experiments.config.default_config`). ``ALGORITHM`` is a shortcut for ``--method.name`` and
``--coder.name`` (``fedpm_klms``: method ``fedpm``, coder ``klms``). A flag for a field the chosen method or
coder does not have is an error.

Rules for the results folder:

- a new run refuses an ``--output`` that already holds a run; ``--resume`` continues it, ``--overwrite``
  replaces it;
- ``--resume`` takes the configuration from the folder's ``config.json`` (a preset or flags given must
  agree with it) and fails before any work if there is no run there; ``--run.rounds N`` extends the run to
  N rounds without rewriting ``config.json`` (each resume is logged in ``resume_log.jsonl``), and without
  it the last target is kept; a folder written before the sectioned config cannot be resumed;
- Ctrl-C stops the run at the end of the current step (a chunk of ``run.eval_every`` rounds, or a part of
  ``run.clients_per_step`` clients of a round), once its checkpoint is written; a second Ctrl-C quits at
  once, from the last checkpoint written (:mod:`experiments.interrupts`). Either way it prints the round of
  the last checkpoint and the command that continues it, and exits with status 130.

Several processes (hosts) run one experiment with ``--run.processes P --run.devices D --run.coordinator
HOST:PORT --run.process_id I`` (the same command in each, ``I = 0..P-1``; see :mod:`experiments.distributed`).

Exit status: 0 done, 2 bad input or folder, 3 stopped on NaN/inf, 4 another process of the run was lost,
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

from experiments import interrupts
from experiments.checkpoint import read_checkpoint_meta
from experiments.coders import CODERS
from experiments.config import (
    DataConfig,
    ExperimentConfig,
    RunConfig,
    default_config,
    field_docs,
    list_presets,
    load_preset,
    preset_description,
)
from experiments.distributed import LOST_STATUS, ProcessLostError
from experiments.driver import (
    InvalidStreamError,
    NonFiniteError,
    check_resumable_folder,
    run_config,
    run_experiment,
)
from experiments.methods import METHODS, SHORTCUTS
from experiments.sections import Section, field_type, parse_word


class FlagError(ValueError):
    """A flag for a field that the chosen method or coder does not have (argparse's error, exit status 2)."""


def _value_parser(base: type, optional: bool):
    def parse(text: str):
        try:
            return parse_word(base, optional, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = base.__name__  # argparse names the type in its errors
    return parse


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(_fmt, value))
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _flag_help(table: str, name: str, owners: dict[str, type[Section]], doc: str) -> str:
    """The flag's doc, then which methods/coders have it and their defaults."""
    defaults: dict[str, list[str]] = {}
    for owner, cls in owners.items():
        defaults.setdefault(_fmt(cls.defaults()[name]), []).append(owner)
    if len(owners) == 1 or len(defaults) == 1:
        text = f"default {next(iter(defaults))}"
    else:
        text = "default " + "; ".join(f"{v} for {', '.join(names)}" for v, names in defaults.items())
    if table == "coder":
        tuned: dict[str, list[str]] = {}
        for method, cls in METHODS.items():
            for coder, values in cls.coder_defaults.items():
                if coder in owners and name in values:
                    tuned.setdefault(_fmt(values[name]), []).append(method)
        if tuned:
            text += "; without a preset, as tuned for the method: " + "; ".join(
                f"{v} for {', '.join(methods)}" for v, methods in tuned.items()
            )
    head = f"{table}s {', '.join(owners)}; " if table in ("method", "coder") else ""
    # argparse %-formats help strings: a literal '%' in a doc ("50% of 1,000") must be escaped
    return f"{doc.rstrip('.')} ({head}{text})".replace("%", "%%")


def _owners_of(table: str) -> dict[str, dict[str, type[Section]]]:
    """``{field: {owner name: class}}`` for a table (run and data have one class, owner ``""``)."""
    registry = {"run": {"": RunConfig}, "data": {"": DataConfig}, "method": METHODS, "coder": CODERS}[table]
    owners: dict[str, dict[str, type[Section]]] = {}
    for owner, cls in registry.items():
        for name in cls.field_names():
            owners.setdefault(name, {})[owner] = cls
    return owners


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps help at spaces only (not inside ``re-partition`` or ``--list-presets``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


_TABLE_TITLES = {
    "run": "[run] table: seed, rounds, evaluation",
    "data": "[data] table: dataset, model, federation",
    "method": "[method] table: the method and its fields (each flag says which methods have it)",
    "coder": "[coder] table: the coder of the messages and its fields (each flag says which coders have it)",
}


def build_parser(focus: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. ``focus`` (``{"method": name, "coder": name}``, either may be missing)
    limits ``--help`` to the [method] and [coder] flags those have (every flag still parses; ``None``: all
    of them, as ``--help-all`` shows)."""
    p = argparse.ArgumentParser(
        prog="python -m experiments.run",
        usage="python -m experiments.run [ALGORITHM] [--preset NAME] [--output DIR] [--resume | --overwrite] "
        "[--TABLE.FIELD VALUE ...]",
        description=textwrap.fill(
            "Run a sidejax federated experiment and write a results folder (config.json, metrics.jsonl/.csv, "
            "summary.json, plots, checkpoint/). Run it from the repository root. A flag --TABLE.FIELD sets a "
            "field of the configuration's [run], [data], [method] or [coder] table (as in a preset's TOML; "
            "'none' unsets an optional field). Values come from, in order of precedence: the flags given, "
            "the --preset, the method's and coder's defaults (shown per flag); with --resume, the run's "
            "saved config.json replaces the last two. A flag for a field the chosen method or coder does not "
            "have is an error. Ctrl-C stops a run and prints the command that resumes it.",
            width=100,
        ),
        epilog=(
            "examples:\n"
            "  python -m experiments.run signsgd --run.rounds 10          # digits, MLP, tuned defaults\n"
            "  python -m experiments.run fedpm_klms --coder.log2_num_candidates 6 --method.client_lr 0.05\n"
            "  python -m experiments.run --method.name sgld --coder.name float32   # no shortcut for it\n"
            "  python -m experiments.run --preset demo_digits_qsgd_klms   # < 1 min on a CPU\n"
            "  python -m experiments.run --output results/x --resume --run.rounds 40   # continue / extend\n"
            "exit status: 0 done, 2 bad input or results folder, 3 stopped on NaN/inf, 4 another process of "
            "the run was lost, 130 interrupted"
        ),
        formatter_class=_HelpFormatter,
    )
    pairs = ", ".join(f"{name} ({m}+{c})" for name, (m, c) in SHORTCUTS.items())
    p.add_argument(
        "algorithm",
        nargs="?",
        choices=sorted(SHORTCUTS),
        metavar="ALGORITHM",
        help=f"a method and coder pair: {pairs} (or give --method.name and --coder.name, or take them from "
        f"--preset)",
    )
    run = p.add_argument_group("run and results folder")
    run.add_argument(
        "--preset", metavar="NAME", help="named preset from experiments/presets (see --list-presets)"
    )
    run.add_argument("--list-presets", action="store_true", help="list the presets with their descriptions")
    run.add_argument(
        "--help-all",
        action="store_true",
        help="--help with the flags of every method and coder (--help shows those of the chosen ones)",
    )
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
        "--run.rounds N extends it to N rounds (config.json is kept; the extension goes to "
        "resume_log.jsonl)",
    )
    run.add_argument("--overwrite", action="store_true", help="replace a run already in the output folder")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--quiet", action="store_true", help="no per-round table")
    _add_table_flags(p, focus)
    return p


def _add_table_flags(p: argparse.ArgumentParser, focus: dict[str, str] | None) -> None:
    """One group of ``--TABLE.FIELD`` flags per table (with ``--method.name``/``--coder.name``); a method's
    or coder's field outside ``focus`` parses but is hidden from ``--help``."""
    docs = field_docs()
    for table, title in _TABLE_TITLES.items():
        group = p.add_argument_group(title)
        if table in ("method", "coder"):
            registry = METHODS if table == "method" else CODERS
            group.add_argument(
                f"--{table}.name",
                dest=f"{table}.name",
                choices=list(registry),
                metavar="NAME",
                default=argparse.SUPPRESS,
                help=f"the {table}: {', '.join(registry)}",
            )
        for name, owners in _owners_of(table).items():
            hidden = focus is not None and table in ("method", "coder") and focus.get(table) not in owners
            _add_field_flag(group, table, name, owners, docs[f"{table}.{name}"], hidden=hidden)


def _add_field_flag(
    group, table: str, name: str, owners: dict[str, type[Section]], doc: str, *, hidden: bool
):
    """The flag ``--TABLE.NAME`` of a field that ``owners`` (the methods or coders that have it) share: its
    type, its choices (the union of the owners'), and its help (``doc``, the owners and their defaults)."""
    kinds = [field_type(cls, name) for cls in owners.values()]
    bases, choices = {(k.base, k.many) for k in kinds}, [cls.choices(name) for cls in owners.values()]
    assert len(bases) == 1, f"{table}.{name} has different types in its owners"
    assert len({bool(c) for c in choices}) == 1, f"{table}.{name} is a choice in some owners only"
    # the union of the owners' choices (e.g. client_optimizer: the mask methods also take
    # "mirror"); the chosen section checks its own
    choice = tuple(dict.fromkeys(c for cs in choices if cs for c in cs)) or choices[0]
    ((base, many),), optional = bases, any(k.optional for k in kinds)
    owner_names = {k: v for k, v in owners.items() if k} or owners
    text = doc
    if choice and not all(c in text for c in choice):
        text = f"{text.rstrip('.')}: {', '.join(choice)}"
    group.add_argument(
        f"--{table}.{name}",
        dest=f"{table}.{name}",
        type=str.lower if choice else _value_parser(base, optional),
        choices=choice,
        nargs="+" if many else None,
        metavar="{true,false}" if base is bool else "NAME" if choice else base.__name__.upper(),
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS
        if hidden
        else _flag_help(table, name, owner_names, text)
        if table in ("method", "coder")
        else (f"{text.rstrip('.')} (default {_fmt(next(iter(owners.values())).defaults()[name])})"),
    )


def _help_focus(argv: list[str]) -> dict[str, str]:
    """For ``--help``: the method and coder the rest of ``argv`` chooses (an ALGORITHM, --method.name /
    --coder.name, a --preset), without reading anything else; unknown names are left to the full parse."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("algorithm", nargs="?")
    pre.add_argument("--preset")
    pre.add_argument("--method.name", dest="method")
    pre.add_argument("--coder.name", dest="coder")
    known, _ = pre.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    focus: dict[str, str] = {}
    if known.preset:
        try:
            config = load_preset(known.preset)
            focus = {"method": config.method.name, "coder": config.coder.name}
        except (ValueError, FileNotFoundError):
            pass
    if known.algorithm in SHORTCUTS:
        focus = dict(zip(("method", "coder"), SHORTCUTS[known.algorithm], strict=True))
    if known.method in METHODS:
        focus["method"] = known.method
        if known.coder is None:
            focus["coder"] = METHODS[known.method].default_coder
    if known.coder in CODERS:
        focus["coder"] = known.coder
    return focus


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--table.field`` flags given, as dotted keys; ``ALGORITHM`` as ``method.name``/``coder.name``."""
    given = {k: v for k, v in vars(args).items() if "." in k}
    if args.algorithm:
        method, coder = SHORTCUTS[args.algorithm]
        if given.get("method.name", method) != method:
            raise ValueError(
                f"ALGORITHM {args.algorithm} is method {method!r}, but --method.name {given['method.name']} "
                f"was given: give one"
            )
        given["method.name"] = method
        given.setdefault("coder.name", coder)
    return given


def _check_flags(base: ExperimentConfig, given: dict[str, Any]) -> None:
    """Raises :class:`FlagError` for a ``--method.*`` / ``--coder.*`` flag the chosen method or coder (as
    ``base.override(given)`` picks them) does not have, naming the flag and the ones that have it."""
    method, coder = base.names_after(given, source="command line")
    for table, name, registry in (("method", method, METHODS), ("coder", coder, CODERS)):
        fields = registry[name].field_names()
        for key in given:
            t, _, f = key.partition(".")
            if t == table and f != "name" and f not in fields:
                have = [n for n, cls in registry.items() if f in cls.field_names()]
                raise FlagError(
                    f"--{key}: {table} {name!r} has no field {f!r} ({table}s with it: {', '.join(have)}); "
                    f"its fields: {', '.join(fields) or 'none'}"
                )


def resolve(args: argparse.Namespace) -> tuple[ExperimentConfig, Path]:
    """The run's configuration and results folder from parsed arguments (see the module docstring).

    Raises:
      FlagError: a flag for a field the chosen method or coder does not have.
      ValueError: bad or missing values.
      FileNotFoundError: ``--resume`` without a run in the results folder.
    """
    given = _given(args)
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --output, --overwrite replaces it: give one")
    if not args.preset and "method.name" not in given and not (args.resume and args.output):
        raise ValueError("give an ALGORITHM, --method.name or a --preset (see --help, --list-presets)")
    preset = load_preset(args.preset) if args.preset else None
    base = preset
    if base is None and "method.name" in given:
        base = default_config(**{k: given[k] for k in ("method.name", "coder.name") if k in given})
    name = args.preset
    if base is not None:
        _check_flags(base, given)
        config = base.override(given, source="command line")
        if not name:
            name = f"{config.algorithm}_{config.data.dataset}_{config.data.model}_s{config.run.seed}"
    out = args.output or Path("results") / name
    if args.resume:
        # continue the saved run: its config.json is the base (or the preset, which must agree with it, as
        # must the flags given: the driver checks), and the target rounds is --run.rounds if given, else the
        # last target recorded in the checkpoint
        check_resumable_folder(out)
        saved = run_config(json.loads((out / "config.json").read_text()), source=str(out / "config.json"))
        base = preset or saved
        if "run.rounds" not in given:
            target = read_checkpoint_meta(out / "checkpoint").get("rounds_target", saved.run.rounds)
            given = {**given, "run.rounds": target}
        _check_flags(base, given)
        config = base.override(given, source="command line")
    return config, out


def _resume_command(out: Path, rounds: int) -> str:
    """The command that continues the run in ``out`` (the interpreter as it was started)."""
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join(
        [str(exe), "-m", "experiments.run", "--output", str(out), "--resume", "--run.rounds", str(rounds)]
    )


def _interrupted(out: Path, rounds: int) -> int:
    """Ctrl-C: say where the run stopped and how to continue it; exit status 130 (128 + SIGINT)."""
    try:
        meta = read_checkpoint_meta(out / "checkpoint")
        done = meta["round_index"]
    except (OSError, ValueError, KeyError):
        meta, done = {}, None
    if done is None or not (out / "config.json").is_file():
        print(
            f"\ninterrupted before the first checkpoint of {out}: nothing to resume; run the same command "
            f"again with --overwrite",
            file=sys.stderr,
        )
    else:
        inside = ""
        if "clients_done" in meta:
            inside = f" and {meta['clients_done']} of the {meta['round_clients']} clients of round {done + 1}"
        print(
            f"\ninterrupted: the last checkpoint in {out} is at round {done} of {rounds}{inside}. To "
            f"continue:\n"
            f"    {_resume_command(out, rounds)}",
            file=sys.stderr,
        )
    return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    focus = None
    if ("-h" in argv or "--help" in argv) and "--help-all" not in argv:
        focus = _help_focus(argv)
    parser = build_parser(focus)
    if "--help-all" in argv:
        parser.print_help()
        return 0
    if focus is not None:
        chosen = " and ".join(f"{t} {n!r}" for t, n in focus.items())
        parser.epilog += (
            f"\n[method] and [coder] flags shown: those of {chosen} (--help-all: every method's and coder's)"
            if focus
            else "\n[method] and [coder] flags: give an ALGORITHM, --method.name or a --preset with --help "
            "to see the chosen ones' (python -m experiments.run fedpm_klms --help), or --help-all for all"
        )
    try:
        args = parser.parse_args(argv)
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
    except FlagError as e:
        try:
            parser.error(str(e))  # the usage and the error, exit status 2
        except SystemExit as exit_:
            return int(exit_.code)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with interrupts.handle_ctrl_c(lambda: _interrupted(out, config.run.rounds)) as ctrl_c:
        status = _run(args, config, out)
        if status == 130:  # the message once (the Ctrl-C watcher may be printing it too)
            return ctrl_c.report() if ctrl_c else _interrupted(out, config.run.rounds)
    return status


def _run(args: argparse.Namespace, config: ExperimentConfig, out: Path) -> int:
    """Runs the experiment and prints its outcome; the command's exit status."""
    try:
        summary = run_experiment(
            config,
            out,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            verbose=not args.quiet,
        )
    except KeyboardInterrupt:  # stopped at a safe point (interrupts.stop_point), or no Ctrl-C handler
        return 130
    except (NonFiniteError, InvalidStreamError) as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except ProcessLostError as e:
        print(f"stopped: {e}", file=sys.stderr)
        interrupts.flush_output()
        # not sys.exit: at exit JAX's distributed client waits on a shutdown barrier with the lost process,
        # then aborts the interpreter (status 134) with a page of C++ log
        os._exit(LOST_STATUS)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.run.process_id > 0:
        print(f"process {config.run.process_id} done: {summary.rounds_run} rounds (process 0 wrote results)")
        return 0
    personal = ""
    if summary.final_personal_accuracy is not None:
        personal = (
            f"final personal accuracy {100 * summary.final_personal_accuracy:.2f}%, "
            f"best {100 * summary.best_personal_accuracy:.2f}%, "
        )
    print(
        f"done: {summary.rounds_run} rounds, final test accuracy {100 * summary.final_accuracy:.2f}%, "
        f"best {100 * summary.best_accuracy:.2f}%, {personal}{summary.total_bits:.4e} bits; results in {out}"
    )
    return 0


if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):  # `--list-presets | head` ends quietly, as other command-line tools do
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    interrupts.exit_process(main())
