"""CoreSet-PFedBayes experiments: the paper's settings as presets, and its personal / global accuracy table.

Examples::

    # the reduced CPU setting (Fashion-MNIST, MLP 784-100-10, 60 rounds): every method, three seeds
    python -m experiments.coreset_pfedbayes table results/coreset_fmnist --setting fmnist_mlp_cpu \\
        --seeds 0 1 2
    # only the 50% comparison, a quick look
    python -m experiments.coreset_pfedbayes table results/quick --setting fmnist_mlp_cpu --rounds 5 \\
        --only coreset_50 random_50
    # rewrite the shipped presets from the definitions below (a test checks they are up to date)
    python -m experiments.coreset_pfedbayes presets

A **setting** (:data:`SETTINGS`) is the paper's federation (docs/papers/coreset_pfedbayes.md#s3-1): pFedMe's
non-iid split (train and test pooled; 10 clients x 5 labels, client ``u`` holding labels
``{(5u + j) mod 10}``, 1,000 examples per (client, label), 20% train = 1,000 / 80% test = 4,000 per client;
``data.partition = "pfedme"``), the Bayesian MLP 784-100-10 (79,510 parameters, a mean-field Gaussian over
them), all clients every round. Paper settings (MNIST, Fashion-MNIST; 200 rounds, coreset weights every
round, for a GPU) and the reduced CPU setting ``fmnist_mlp_cpu`` (60 rounds, coreset weights every 10
rounds). MNIST is read from local files or tensorflow-datasets (``sidejax.data``), never downloaded.

A **method** is a row of the paper's Tables 1/3 (:data:`METHODS`): FedAvg (pFedMe's baseline settings:
lr 0.005, batch 20, 20 local epochs), pFedBayes on the full data, RandomSubset (pFedBayes on a fixed random
50% subset, unit weights as in the paper, and reweighted by n/k), CoreSet-PFedBayes at 50/30/15/10% coresets.
Preset ``coreset_pfedbayes_<setting>_<method>``.

The table (``table.md`` / ``table.csv``) has one row per method, the mean ± std over the seeds found:

- ``personal acc``: the best over evaluations of the personal models' accuracy, each client's model on its
  own test set, pooled over clients (docs/papers/coreset_pfedbayes.md#s2-6; the paper's reported number is the
  max over rounds); ``final personal``: the last evaluation;
- ``global acc`` / ``final global``: the same for the server's model (the posterior mean) on the pooled
  test sets;
- ``rounds to 99%``: the first evaluated round whose personal accuracy reaches 99% of that run's best (the
  [R] reading of Table 3's "communication rounds", docs/papers/coreset_pfedbayes.md#s2-6);
- ``uplink floats``: floats sent per client per round, measured from the messages (bits / 32);
- ``seeds``: the runs averaged.

The plot ``accuracy_vs_round.png`` shows personal (solid) and global (dashed) accuracy against the round,
one colour per method, the mean over seeds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from experiments.config import PRESET_DIR, ExperimentConfig, default_config, load_preset, preset_toml
from experiments.table import by_label, mean_std, read_run_folders, suite_main

__all__ = ["SETTINGS", "METHODS", "suite_config", "preset_name", "write_presets", "collect", "main"]

_FED = {
    "data.model": "mlp_100",
    "data.num_clients": 10,
    "data.participation": 1.0,
    "data.partition": "pfedme",
    "data.labels_per_client": 5,
    "data.examples_per_label": 1000,
    "data.train_fraction": 0.2,
}
_RUN = {"run.rounds": 200, "run.eval_every": 5, "run.eval_batch_size": 2000, "run.client_strategy": "auto"}
_CPU = {**_RUN, "run.rounds": 60}

#: setting -> (description, dotted overrides of [run] and [data], overrides of the coreset methods)
SETTINGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "mnist_mlp": (
        "paper Tables 1/3: MNIST, MLP 784-100-10, 10 clients x 5 labels (1,000 train / 4,000 test each), 200 "
        "rounds, coreset weights every round",
        {**_RUN, **_FED, "data.dataset": "mnist"},
        {"method.coreset_every": 1},
    ),
    "fmnist_mlp": (
        "paper Tables 1/3: Fashion-MNIST, MLP 784-100-10, 10 clients x 5 labels (1,000 train / 4,000 test "
        "each), 200 rounds, coreset weights every round",
        {**_RUN, **_FED, "data.dataset": "fashion_mnist"},
        {"method.coreset_every": 1},
    ),
    "fmnist_mlp_cpu": (
        "reduced CPU setting: Fashion-MNIST, MLP 784-100-10, 10 clients x 5 labels (1,000 train / 4,000 test "
        "each), 60 rounds, coreset weights every 10 rounds",
        {**_CPU, **_FED, "data.dataset": "fashion_mnist"},
        {"method.coreset_every": 10},
    ),
}

#: method -> (table label, [method] name, overrides); the coreset methods also take the setting's overrides
METHODS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "fedavg": (
        "FedAvg",
        "fedavg",
        {
            "method.client_optimizer": "sgd",
            "method.client_lr": 0.005,
            "method.batch_size": 20,
            "method.local_epochs": 20,
        },
    ),
    "pfedbayes": ("PFedBayes (full)", "pfedbayes", {}),
    "random_50": ("RandomSubset (50%)", "pfedbayes_subset", {"method.subset_size": 500}),
    "random_50_rw": (
        "RandomSubset (50%, weights n/k)",
        "pfedbayes_subset",
        {"method.subset_size": 500, "method.reweight": True},
    ),
    "coreset_50": ("CoreSet-PFedBayes (50%)", "coreset_pfedbayes", {"method.coreset_size": 500}),
    "coreset_30": ("CoreSet-PFedBayes (30%)", "coreset_pfedbayes", {"method.coreset_size": 300}),
    "coreset_15": ("CoreSet-PFedBayes (15%)", "coreset_pfedbayes", {"method.coreset_size": 150}),
    "coreset_10": ("CoreSet-PFedBayes (10%)", "coreset_pfedbayes", {"method.coreset_size": 100}),
}


def preset_name(setting: str, method: str) -> str:
    return f"coreset_pfedbayes_{setting}_{method}"


def suite_config(setting: str, method: str) -> ExperimentConfig:
    """The configuration of ``method`` in ``setting`` (preset ``coreset_pfedbayes_<setting>_<method>``)."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; settings: {', '.join(SETTINGS)}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    _, values, coreset = SETTINGS[setting]
    _, name, extra = METHODS[method]
    extra = {**extra, **coreset} if name == "coreset_pfedbayes" else extra
    return default_config(f"{name}+float32").override(
        {**values, **extra}, source=preset_name(setting, method)
    )


def write_presets(directory: Path = PRESET_DIR) -> list[Path]:
    """Writes every (setting, method) preset as canonical TOML; returns the paths."""
    paths = []
    for setting, (description, _, _) in SETTINGS.items():
        for method, (label, _, _) in METHODS.items():
            path = Path(directory) / f"{preset_name(setting, method)}.toml"
            path.write_text(preset_toml(suite_config(setting, method), f"{label}; {description}"))
            paths.append(path)
    return paths


def _label(config: dict[str, Any]) -> str:
    method = config["method"]
    name = method["name"]
    if name in ("coreset_pfedbayes", "pfedbayes_subset"):
        k = method["coreset_size" if name == "coreset_pfedbayes" else "subset_size"]
        n = _train_size(config)
        size = f"{round(100 * k / n)}%" if n else f"k = {k}"
        if name == "coreset_pfedbayes":
            return f"CoreSet-PFedBayes ({size})"
        return f"RandomSubset ({size}, weights n/k)" if method.get("reweight") else f"RandomSubset ({size})"
    return {"fedavg": "FedAvg", "pfedbayes": "PFedBayes (full)"}.get(name, name)


def _train_size(config: dict[str, Any]) -> int | None:
    """Training examples per client of pFedMe's split (every client holds the same number); ``None`` for
    other partitions, where the table names coresets by their size ``k`` instead of a percentage."""
    data = config["data"]
    if data.get("partition") != "pfedme":
        return None
    return max(1, round(data["train_fraction"] * data["labels_per_client"] * data["examples_per_label"]))


_ORDER = [v[0] for v in METHODS.values()]


def collect(directory: Path) -> list[dict[str, Any]]:
    """Every finished run folder under ``directory`` with its label (a damaged folder is skipped with a
    warning, :func:`experiments.table.read_run_folders`)."""
    runs = []
    for sub, config, summary, rows in read_run_folders(directory):
        try:
            label = _label(config)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            print(f"warning: skipped {sub}: unreadable config ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        runs.append({"name": sub.name, "label": label, "config": config, "summary": summary, "rows": rows})
    runs.sort(key=lambda r: (_ORDER.index(r["label"]) if r["label"] in _ORDER else len(_ORDER), r["name"]))
    return runs


def _evaluated(rows, key):
    return [(r["round"], r[key]) for r in rows if r.get(key) is not None]


def rounds_to_fraction(rows, key: str = "personal_accuracy", fraction: float = 0.99):
    """The first evaluated round whose ``key`` reaches ``fraction`` of the run's best (None: none
    evaluated)."""
    pts = _evaluated(rows, key)
    if not pts:
        return None
    best = max(v for _, v in pts)
    return next(r for r, v in pts if v >= fraction * best)


def _run_numbers(run) -> dict[str, float | None]:
    rows = run["rows"]
    key = "personal_accuracy" if _evaluated(rows, "personal_accuracy") else "test_accuracy"
    personal = [v for _, v in _evaluated(rows, "personal_accuracy")]
    glob = [v for _, v in _evaluated(rows, "test_accuracy")]
    floats = [r["uplink_bits"] / 32 / _participants(run) for r in rows if r.get("uplink_bits") is not None]
    return {
        "personal": 100 * max(personal) if personal else None,
        "final_personal": 100 * personal[-1] if personal else None,
        "global": 100 * max(glob) if glob else None,
        "final_global": 100 * glob[-1] if glob else None,
        "rounds99": rounds_to_fraction(rows, key),
        "floats": sum(floats) / len(floats) if floats else None,
    }


def _participants(run) -> int:
    return max(1, int(run["config"].get("clients_per_round") or run["config"]["data"]["num_clients"]))


COLUMNS = (
    "method",
    "personal acc (%)",
    "final personal (%)",
    "global acc (%)",
    "final global (%)",
    "rounds to 99%",
    "uplink floats / client / round",
    "seeds",
    "runs",
)


def table_rows(runs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per method label: mean ± sample std over its runs (seeds)."""
    groups = by_label(runs)
    out = []
    for label, group in groups.items():
        nums = [_run_numbers(r) for r in group]
        out.append(
            {
                "method": label,
                "personal acc (%)": mean_std([n["personal"] for n in nums], ".2f"),
                "final personal (%)": mean_std([n["final_personal"] for n in nums], ".2f"),
                "global acc (%)": mean_std([n["global"] for n in nums], ".2f"),
                "final global (%)": mean_std([n["final_global"] for n in nums], ".2f"),
                "rounds to 99%": mean_std([n["rounds99"] for n in nums], ".0f"),
                "uplink floats / client / round": mean_std([n["floats"] for n in nums], ".0f"),
                "seeds": ", ".join(str(r["config"]["run"]["seed"]) for r in group),
                "runs": ", ".join(r["name"] for r in group),
            }
        )
    return out


def plot(runs: list[dict[str, Any]], path: Path, *, title: str | None = None) -> Path:
    """Personal (solid) and global (dashed) accuracy against the round, the mean over each method's seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_label(runs)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (label, group) in enumerate(groups.items()):
        colour = f"C{i % 10}"
        for key, style, suffix in (("personal_accuracy", "-", "personal"), ("test_accuracy", "--", "global")):
            curves = [dict(_evaluated(r["rows"], key)) for r in group]
            common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not common:
                continue
            mean = [100 * statistics.fmean(c[t] for c in curves) for t in common]
            ax.plot(common, mean, style, color=colour, marker=".", label=f"{label} {suffix}")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (%)")
    if title:
        ax.set_title(f"{title}: personal (solid) and global (dashed), mean over seeds", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    return suite_main(
        argv,
        module="coreset_pfedbayes",
        description=__doc__.split("\n")[0],
        settings=SETTINGS,
        variants={name: v[0] for name, v in METHODS.items()},
        noun="methods",
        preset_name=preset_name,
        write_presets=write_presets,
        load=lambda name: load_preset(name),  # looked up at call time (tests replace it)
        collect=collect,
        table_rows=table_rows,
        columns=COLUMNS,
        plot=plot,
        figure_name="accuracy_vs_round.png",
    )


if __name__ == "__main__":
    sys.exit(main())
