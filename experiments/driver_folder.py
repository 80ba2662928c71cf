"""The results folder of a run, and the one rule for it: a new run writes only into a folder that does not
exist or is empty (:func:`check_new_output`), unless asked to ``overwrite`` (which removes only a run's own
files, :func:`remove_run`); ``resume`` needs a run of the same configuration with a checkpoint there
(:func:`same_run_config`). Every check reads the folder and creates nothing. The folder's layout is in
:mod:`experiments.driver`."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from experiments import distributed
from experiments.checkpoint import checkpoint_exists
from experiments.config import TABLES, ExperimentConfig, OldConfigError, config_from_dict
from experiments.driver_plots import PLOT_FILES

__all__ = [
    "RUN_FILES",
    "FINAL_PARAMS",
    "DERIVED_KEYS",
    "RunExistsError",
    "run_config",
    "is_run_folder",
    "check_new_output",
    "check_resumable_folder",
    "same_run_config",
    "check_output",
    "remove_run",
    "write_config",
    "log_resume",
]

RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "metrics.csv",
    "summary.json",
    "resume_log.jsonl",
    *PLOT_FILES,
)
"""The files a run writes in its folder (besides ``checkpoint/``): what ``overwrite`` removes."""


#: the folder (a checksummed checkpoint file) holding a finished run's final model: the evaluated parameters,
#: or the first posterior sample of an ensemble (BPC-FL + SGD/Adam: the MAP estimate); what ``run.init_from``
#: of another run loads (BPC-FL as a FedAvg warm start, docs/papers/bpcfl.md#a6)
FINAL_PARAMS = "final_params"


#: the derived values ``config.json`` holds besides the config's tables
DERIVED_KEYS = ("algorithm", "clients_per_round", "num_params")


def run_config(saved: dict[str, Any], *, source: str = "config.json") -> ExperimentConfig:
    """The :class:`ExperimentConfig` of a run folder's ``config.json`` (derived values dropped).

    Raises:
      OldConfigError: a flat ``config.json``, written by a sidejax version before the sectioned config.
      ValueError: any other bad content.
    """
    if any(t in saved for t in TABLES):
        saved = {k: v for k, v in saved.items() if k not in DERIVED_KEYS}
    try:
        return config_from_dict(saved, source=source)
    except OldConfigError:
        raise OldConfigError(
            f"{source} was written by an older sidejax version (a flat config, before the [run], [data], "
            f"[method] and [coder] tables): this version cannot resume or re-read the run; start it again "
            f"(--overwrite), or use the version that wrote it"
        ) from None


class RunExistsError(FileExistsError):
    """The output folder already holds a run, and neither ``resume`` nor ``overwrite`` was asked for."""


def is_run_folder(output_dir: str | Path) -> bool:
    """Whether ``output_dir`` holds (part of) a run: a config, metrics or a checkpoint."""
    out = Path(output_dir)
    return (
        (out / "config.json").is_file()
        or (out / "metrics.jsonl").is_file()
        or checkpoint_exists(out / "checkpoint")
    )


def check_new_output(out: str | Path, *, overwrite: bool, flag: str = "--output") -> None:
    """The one rule for a folder a new run writes into: it must not exist, or be empty, unless
    ``overwrite``. Raises :class:`RunExistsError` naming what is there (and ``--resume`` when a run there
    can be continued); ``ValueError`` if ``out`` is a file. Reads only the folder's listing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder: choose a folder for the results")
    if overwrite or not out.exists():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if is_run_folder(out):
        resumable = (out / "config.json").is_file() and checkpoint_exists(out / "checkpoint")
        raise RunExistsError(
            f"{out} already holds a run (config.json, metrics or checkpoint/); "
            + ("pass --resume to continue it, " if resumable else "")
            + f"pass --overwrite to replace it, or choose another {flag}"
        )
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    raise RunExistsError(
        f"{out} is not empty ({shown}) and holds no run to continue: choose another {flag} (a new or empty "
        "folder), or pass --overwrite to write into it (files of the same names are replaced)"
    )


def remove_run(out: Path) -> None:
    """Removes a run's files (:data:`RUN_FILES`), its checkpoint and its final model from ``out``; other
    files there stay."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for folder in ("checkpoint", FINAL_PARAMS):
        if (out / folder).is_dir():
            shutil.rmtree(out / folder)


def check_resumable_folder(output_dir: str | Path) -> None:
    """Raises ``FileNotFoundError`` (saying what to do instead) unless ``output_dir`` holds a run with a
    ``config.json`` and a checkpoint. Reads nothing else and creates nothing."""
    out = Path(output_dir)
    if (out / "config.json").is_file() and checkpoint_exists(out / "checkpoint"):
        return
    if not out.exists():
        hint = "the folder does not exist; start the run without --resume"
    elif is_run_folder(out):
        hint = "a run was started there but has no config.json and checkpoint to continue from; start it "
        hint += "again with --overwrite"
    else:
        hint = "the folder has no config.json and checkpoint/; start the run without --resume"
    raise FileNotFoundError(f"--resume: no run to resume in {out} ({hint})")


def same_run_config(output_dir: str | Path, config: ExperimentConfig) -> ExperimentConfig:
    """Checks, before any work, that ``output_dir`` holds a run of ``config`` (every field but
    ``run.rounds`` and the launch settings) with a checkpoint; used by ``--resume`` and by the suites.
    Returns the saved config (with ``config``'s rounds and launch settings).

    Raises:
      ValueError: naming the fields that differ (or the topology to resume on).
      FileNotFoundError: no run with a checkpoint there.
    """
    out = Path(output_dir)
    check_resumable_folder(out)
    saved = run_config(json.loads((out / "config.json").read_text()), source=str(out / "config.json"))
    launch = {k: config.flat()[k] for k in distributed.LAUNCH_FIELDS}
    if saved.override({"run.rounds": config.run.rounds, **launch}) != config:
        now, then = config.flat(), saved.flat()
        ignore = ("run.rounds", *distributed.LAUNCH_FIELDS)
        diff = {k: (v, then.get(k)) for k, v in now.items() if k not in ignore and then.get(k) != v}
        diff.update({k: (None, v) for k, v in then.items() if k not in now})
        if set(diff) <= {"run.devices", "run.processes"}:
            raise ValueError(
                f"--resume: the run in {out} was checkpointed on {saved.run.devices} device(s) in "
                f"{saved.run.processes} process(es), and this run asks for {config.run.devices} in "
                f"{config.run.processes}: resume it on the same topology (--run.devices "
                f"{saved.run.devices} --run.processes {saved.run.processes}); a run's rounds are bit-exact "
                "only on the topology that started them"
            )
        raise ValueError(f"--resume: config differs from the checkpointed run in {out} (now, saved): {diff}")
    return saved.override({"run.rounds": config.run.rounds, **launch})


def check_output(out: Path, config: ExperimentConfig, *, resume: bool, overwrite: bool) -> None:
    """The folder rules of :func:`experiments.driver.run_experiment`, checked before any work: ``resume``
    needs a run of ``config`` there (:func:`same_run_config`), a new run a new or empty folder unless
    ``overwrite`` (:func:`check_new_output`); asking for both is an error."""
    if resume and overwrite:
        raise ValueError(
            "resume and overwrite exclude each other: resume continues the run in the folder, "
            "overwrite replaces it"
        )
    if resume:
        same_run_config(out, config)
    else:
        check_new_output(out, overwrite=overwrite)


def write_config(out: Path, config: ExperimentConfig, num_params: int) -> None:
    """Creates ``out`` and writes ``config.json``: the config's tables and :data:`DERIVED_KEYS`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps(
            {
                "algorithm": config.algorithm,
                **config.to_dict(),
                "clients_per_round": config.clients_per_round,
                "num_params": num_params,
            },
            indent=2,
        )
    )


def log_resume(out: Path, from_round: int, rounds: int) -> None:
    """Appends ``{"time", "from_round", "rounds"}`` to ``resume_log.jsonl``: one line per resume."""
    with (out / "resume_log.jsonl").open("a") as f:
        entry = {"time": datetime.now(UTC).isoformat(timespec="seconds"), "from_round": from_round}
        f.write(json.dumps({**entry, "rounds": rounds}) + "\n")
