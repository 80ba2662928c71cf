"""CoreSet-PFedBayes experiments: the paper's settings as presets, and its personal / global accuracy table.

Examples (``python -m experiments.suite`` documents every command; ``presets`` rewrites the preset files
from the definitions below, which a test checks)::

    # the reduced CPU setting (Fashion-MNIST, MLP 784-100-10, 60 rounds): every method, three seeds
    python -m experiments.suite coreset_pfedbayes run results/coreset_fmnist --setting fmnist_mlp_cpu \\
        --seeds 0 1 2
    # only the 50% comparison, a quick look
    python -m experiments.suite coreset_pfedbayes run results/quick --setting fmnist_mlp_cpu --rounds 5 \\
        --only coreset_50 random_50

A **setting** (:data:`SETTINGS`) is the paper's federation (docs/papers/coreset_pfedbayes.md#s3-1): pFedMe's
non-iid split (train and test pooled; 10 clients x 5 labels, client ``u`` holding labels
``{(5u + j) mod 10}``, 1,000 examples per (client, label), 20% train = 1,000 / 80% test = 4,000 per client;
``data.partition = "pfedme"``), the Bayesian MLP 784-100-10 (79,510 parameters, a mean-field Gaussian over
them), all clients every round. Paper settings (MNIST, Fashion-MNIST; 200 rounds, coreset weights every
round, for a GPU) and the reduced CPU setting ``fmnist_mlp_cpu`` (60 rounds, coreset weights every 10
rounds). MNIST is read from local files or tensorflow-datasets (``sidejax.data``), never downloaded.

A **method** is a row of the paper's Tables 1/3 (:data:`METHODS`): FedAvg (pFedMe's baseline settings:
lr 0.005, batch 20, 20 local epochs), pFedMe (its own settings: lr 0.005, personal lr 0.1, lambda 15, K = 5,
R = 20, batch 20), Per-FedAvg (first order, alpha 0.005, beta 0.001, R = 20, batch 20), pFedBayes on the full
data, RandomSubset (pFedBayes on a fixed random 50% subset, unit weights as in the paper, and reweighted by
n/k), CoreSet-PFedBayes at 50/30/15/10% coresets.
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

from typing import Any

from experiments.config import ExperimentConfig, default_config
from experiments.suite import (
    Suite,
    alias,
    by_label,
    draw_figure,
    evaluated,
    mean_by_round,
    seed_cells,
    single_figure,
)

__all__ = ["SETTINGS", "METHODS", "SUITE", "suite_config", "rounds_to_fraction"]

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
    "pfedme": ("pFedMe", "pfedme", {}),
    "perfedavg": ("Per-FedAvg (FO)", "perfedavg", {}),
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


def suite_config(setting: str, method: str) -> ExperimentConfig:
    """The configuration of ``method`` in ``setting`` (preset ``coreset_pfedbayes_<setting>_<method>``)."""
    SUITE.check(setting, method)
    _, values, coreset = SETTINGS[setting]
    _, name, extra = METHODS[method]
    extra = {**extra, **coreset} if name == "coreset_pfedbayes" else extra
    source = SUITE.preset_name(setting, method)
    return default_config(f"{name}+float32").override({**values, **extra}, source=source)


def _label(name: str, config: dict[str, Any]) -> str:
    method = config["method"]
    name = method["name"]
    if name in ("coreset_pfedbayes", "pfedbayes_subset"):
        k = method["coreset_size" if name == "coreset_pfedbayes" else "subset_size"]
        n = _train_size(config)
        size = f"{round(100 * k / n)}%" if n else f"k = {k}"
        if name == "coreset_pfedbayes":
            return f"CoreSet-PFedBayes ({size})"
        return f"RandomSubset ({size}, weights n/k)" if method.get("reweight") else f"RandomSubset ({size})"
    if name == "perfedavg":
        return f"Per-FedAvg ({method.get('variant', 'fo').upper()})"
    return {"fedavg": "FedAvg", "pfedbayes": "PFedBayes (full)", "pfedme": "pFedMe"}.get(name, name)


def _train_size(config: dict[str, Any]) -> int | None:
    """Training examples per client of pFedMe's split (every client holds the same number); ``None`` for
    other partitions, where the table names coresets by their size ``k`` instead of a percentage."""
    data = config["data"]
    if data.get("partition") != "pfedme":
        return None
    return max(1, round(data["train_fraction"] * data["labels_per_client"] * data["examples_per_label"]))


def rounds_to_fraction(rows, key: str = "personal_accuracy", fraction: float = 0.99):
    """The first evaluated round whose ``key`` reaches ``fraction`` of the run's best (None: none
    evaluated)."""
    pts = evaluated(rows, key)
    if not pts:
        return None
    best = max(v for _, v in pts)
    return next(r for r, v in pts if v >= fraction * best)


def _cells(run, runs) -> dict[str, Any]:
    rows = run["rows"]
    key = "personal_accuracy" if evaluated(rows, "personal_accuracy") else "test_accuracy"
    personal = [v for _, v in evaluated(rows, "personal_accuracy")]
    glob = [v for _, v in evaluated(rows, "test_accuracy")]
    participants = max(1, int(run["config"].get("clients_per_round") or run["config"]["data"]["num_clients"]))
    floats = [r["uplink_bits"] / 32 / participants for r in rows if r.get("uplink_bits") is not None]
    return {
        "personal acc (%)": 100 * max(personal) if personal else None,
        "final personal (%)": 100 * personal[-1] if personal else None,
        "global acc (%)": 100 * max(glob) if glob else None,
        "final global (%)": 100 * glob[-1] if glob else None,
        "rounds to 99%": rounds_to_fraction(rows, key),
        "uplink floats / client / round": sum(floats) / len(floats) if floats else None,
        **seed_cells(run),
    }


def plot(runs: list[dict[str, Any]], path, *, title: str | None = None):
    """Personal (solid) and global (dashed) accuracy against the round, the mean over each method's seeds."""

    def draw(ax, plt):
        for i, (label, group) in enumerate(by_label(runs).items()):
            for key, style, suffix in (
                ("personal_accuracy", "-", "personal"),
                ("test_accuracy", "--", "global"),
            ):
                common, mean = mean_by_round(group, key)
                if common:
                    ax.plot(common, mean, style, color=f"C{i % 10}", marker=".", label=f"{label} {suffix}")

    title = title and f"{title}: personal (solid) and global (dashed), mean over seeds"
    return draw_figure(path, draw, xlabel="round", ylabel="accuracy (%)", title=title, wide=True)


SUITE = Suite.of_module(
    globals(),
    variants=METHODS,
    columns=(
        "method | personal acc (%):.2f | final personal (%):.2f | global acc (%):.2f | "
        "final global (%):.2f | rounds to 99%:.0f | uplink floats / client / round:.0f | seeds | "
        "runs"
    ),
    label=_label,
    cells=_cells,
    figure=single_figure("accuracy_vs_round.png", plot),
    per_label=True,
    noun="methods",
)


if __name__ == "__main__":  # the old command, an alias
    alias("coreset_pfedbayes")
