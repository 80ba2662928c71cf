"""BICompFL experiments: the paper's settings as presets, and its table and plot from finished runs.

Examples (``python -m experiments.suite`` documents every command; ``presets`` rewrites the preset files
from the definitions below, which a test checks)::

    # the reduced CPU setting (Fashion-MNIST, LeNet5, 10 iid clients): run every method, then tabulate
    python -m experiments.suite bicompfl run results/bicompfl_fmnist --setting fmnist_lenet5_cpu
    # the same with fewer rounds (a quick look), or only some methods
    python -m experiments.suite bicompfl run results/quick --setting fmnist_lenet5_cpu --rounds 5 \
        --only gr_fixed fedavg

A **setting** is a dataset, model and federation (:data:`SETTINGS`: the paper's MNIST LeNet5 i.i.d.,
MNIST and Fashion-MNIST 4CNN i.i.d. and Dirichlet 0.1, CIFAR-10 6CNN, which run unchanged on a GPU, and the
reduced CPU settings on Fashion-MNIST); a **variant** is a method of the paper's tables (:data:`VARIANTS`:
FedAvg, the bi-directionally compressed baselines, LIEC and M3 included, the six BICompFL rows and the SplitDL
hybrid). Preset ``bicompfl_<setting>_<variant>`` is their combination.

The table has the paper's columns (docs/papers/bicompfl.md#s5), from the messages the runs sent:

- ``acc``: the best test accuracy over the evaluations (the paper's "maximum test accuracy over rounds");
  ``last-5 acc``: the mean of the last five evaluations, beside it;
- ``bpp``: uplink + downlink bits per parameter per client per round, averaged over rounds;
- ``bpp (BC)``: the same on a broadcast channel (a message every client hears is sent once):
  ``uplink + downlink / n`` for one shared downlink message (FedAvg, the baselines, GR-Reconst), the
  relay of all ``n`` streams once for GR, and ``bpp`` for PR's per-client messages. The paper counts GR's
  broadcast as ``(n - 1)`` streams over ``n`` clients (0.059 at 1/32 bit per sample); sent once to
  everybody it is ``n`` streams (0.0625), which is what is measured here;
- ``uplink``, ``downlink``: the two directions.

The plot ``accuracy_vs_total_bpp.png`` shows test accuracy against the cumulative total bits per parameter
per client (the sum over rounds of ``bpp``), log scale, one line per method.
"""

from __future__ import annotations

from typing import Any

from experiments.config import ExperimentConfig, default_config
from experiments.suite import (
    Suite,
    alias,
    by_label,
    draw_figure,
    mean_curve,
    mean_of,
    seed_cells,
    single_figure,
)

__all__ = ["SETTINGS", "VARIANTS", "SUITE", "suite_config", "variant_label"]

# --------------------------------------------------------------------------------------------------
# settings: dataset, model, federation, rounds (docs/papers/bicompfl.md#s4-1)

_PAPER_RUN = {"run.eval_every": 5, "run.eval_batch_size": 2000, "run.client_strategy": "auto"}
_IID = {"data.num_clients": 10, "data.participation": 1.0, "data.partition": "iid"}
_DIR = {**_IID, "data.partition": "dirichlet", "data.alpha": 0.1}


def _paper(description: str, dataset: str, model: str, federation: dict, rounds: int = 200):
    values = {**_PAPER_RUN, **federation, "run.rounds": rounds, "data.dataset": dataset, "data.model": model}
    return description, values, 256, 8


def _cpu(description: str, model: str, subset: int, rounds: int, eval_batch: int):
    """A reduced CPU setting on Fashion-MNIST: 1 local epoch, IS blocks of 128 with 16 candidates."""
    values = {**_PAPER_RUN, **_IID, "run.rounds": rounds, "run.eval_batch_size": eval_batch}
    values |= {"data.dataset": "fashion_mnist", "data.model": model, "data.train_subset": subset}
    return description, {**values, "method.local_epochs": 1}, 128, 4


#: setting -> (description, dotted overrides of [run] and [data], IS block size b and log2 n_IS)
SETTINGS: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "mnist_lenet5_iid": _paper(
        "paper Table 5: MNIST, LeNet5, 10 iid clients, 200 rounds", "mnist", "lenet5", _IID
    ),
    "mnist_conv4_iid": _paper(
        "paper Table 7: MNIST, 4CNN, 10 iid clients, 200 rounds", "mnist", "conv4", _IID
    ),
    "mnist_conv4_dir01": _paper(
        "paper Table 8: MNIST, 4CNN, 10 clients, Dirichlet(0.1) labels, 200 rounds", "mnist", "conv4", _DIR
    ),
    "fmnist_conv4_iid": _paper(
        "paper Fig. 1 / Table 9 (missing from the text): Fashion-MNIST, 4CNN, 10 iid clients, 200 rounds",
        "fashion_mnist",
        "conv4",
        _IID,
    ),
    "fmnist_conv4_dir01": _paper(
        "paper Table 10: Fashion-MNIST, 4CNN, 10 clients, Dirichlet(0.1) labels, 200 rounds",
        "fashion_mnist",
        "conv4",
        _DIR,
    ),
    "cifar10_conv6_iid": _paper(
        "paper Table 11: CIFAR-10, 6CNN, 10 iid clients, 400 rounds", "cifar10", "conv6", _IID, rounds=400
    ),
    "fmnist_lenet5_cpu": _cpu(
        "reduced CPU setting: Fashion-MNIST, LeNet5, 10 iid clients, 20k training examples, 60 rounds of 1 "
        "local epoch; IS blocks of 128 with 16 candidates (the spec's CPU profile, 1/32 bit per sample)",
        "lenet5",
        20000,
        60,
        2000,
    ),
    "fmnist_conv4_cpu": _cpu(
        "reduced CPU setting: Fashion-MNIST, 4CNN, 10 iid clients, 10k training examples, 30 rounds of 1 "
        "local epoch; IS blocks of 128 with 16 candidates",
        "conv4",
        10000,
        30,
        1000,
    ),
}

# --------------------------------------------------------------------------------------------------
# variants: the rows of the paper's tables


def _fixed(b: int, log2k: int) -> dict[str, Any]:
    return {"coder.adaptive": False, "coder.block_size": b, "coder.log2_num_candidates": log2k}


def _downlink(b: int, log2k: int) -> dict[str, Any]:
    # the downlink's CRC-32 off, stated in every preset: the paper's bit counts carry no check (with it, 32
    # more bits per downlink sample; docs/papers/bicompfl.md#dep-extras)
    return {
        **_fixed(b, log2k),
        "method.downlink_block_size": b,
        "method.downlink_num_candidates": 2**log2k,
        "method.downlink_crc32": False,
    }


# the non-stochastic baselines: Adam, local lr 3e-4, server lr 0.1 (docs/papers/bicompfl.md#s4-1 [P])
_DENSE = {"method.client_optimizer": "adam", "method.client_lr": 3e-4, "method.batch_size": 128}
_BASE = {**_DENSE, "method.server_lr": 0.1}
_ADAPTIVE = {"coder.max_block_size": 2048}

#: variant -> (table label, method+coder, overrides given the setting's (b, log2 n_IS))
VARIANTS: dict[str, tuple[str, str, Any]] = {
    "fedavg": ("FedAvg", "fedavg", lambda b, k: {**_BASE, "method.server_optimizer": "sgd"}),
    # the same local training with plain averaging (server step 1): FedAvg as most readers know it, beside
    # the paper's server lr 0.1, which makes it slow at a small number of rounds
    "fedavg_avg": ("FedAvg (server lr 1)", "fedavg", lambda b, k: {**_DENSE}),
    "doublesqueeze": ("DoubleSqueeze", "doublesqueeze+scaled_sign", lambda b, k: _BASE),
    "memsgd": ("MemSGD", "memsgd+scaled_sign", lambda b, k: _BASE),
    "neolithic": ("Neolithic", "neolithic+scaled_sign", lambda b, k: _BASE),
    "cser": ("CSER", "cser+scaled_sign", lambda b, k: {**_BASE, "method.period": 50}),
    "liec": ("LIEC", "liec+scaled_sign", lambda b, k: {**_BASE, "method.period": 50}),
    # server lr 0.02 [P]; TopK(floor(d/n)) uplink, sync probability 1/n, EF21-M momentum 0.1 [A]
    "m3": ("M3", "m3+topk", lambda b, k: {**_DENSE, "method.server_lr": 0.02, "method.momentum": 0.1}),
    "gr_adaptive": (
        "GR-Adaptive",
        "bicompfl_gr+klms",
        lambda b, k: {**_fixed(b, k), **_ADAPTIVE, "coder.adaptive": True},
    ),
    "gr_adaptive_avg": (
        "GR-Adaptive-Avg",
        "bicompfl_gr+klms_avg",
        lambda b, k: {"coder.log2_num_candidates": k, "coder.block_size": b, **_ADAPTIVE},
    ),
    "gr_fixed": ("GR-Fixed", "bicompfl_gr+klms", _fixed),
    "gr_reconst_fixed": ("GR-Reconst-Fixed", "bicompfl_gr_reconst+klms", _downlink),
    "pr_fixed": ("PR-Fixed", "bicompfl_pr+klms", _downlink),
    "pr_fixed_splitdl": (
        "PR-Fixed-SplitDL",
        "bicompfl_pr+klms",
        lambda b, k: {**_downlink(b, k), "method.split_downlink": True},
    ),
    # the paper's hybrid: the split downlinks of theta_1 .. theta_n, one rotation of the n = 10 clients'
    # groups (every coordinate refreshed once, against theta_0), then PR's full downlink
    # (docs/papers/bicompfl.md#s3-6: from the second rotation on a split refresh cannot close its gap)
    "pr_fixed_splitdl_hybrid": (
        "PR-Fixed-SplitDL-Hybrid",
        "bicompfl_pr+klms",
        lambda b, k: {**_downlink(b, k), "method.split_downlink": True, "method.split_rounds": 11},
    ),
}


def suite_config(setting: str, variant: str) -> ExperimentConfig:
    """The configuration of ``variant`` in ``setting`` (preset ``bicompfl_<setting>_<variant>``)."""
    SUITE.check(setting, variant)
    _, values, b, log2k = SETTINGS[setting]
    _, algorithm, extra = VARIANTS[variant]
    values = dict(values)
    if not algorithm.startswith("bicompfl") and "method.local_epochs" not in values:
        values["method.local_epochs"] = 3  # every method: L = 3 local epochs [P]
    name = SUITE.preset_name(setting, variant)
    return default_config(algorithm).override({**values, **extra(b, log2k)}, source=name)


# --------------------------------------------------------------------------------------------------
# the table and the plot


def variant_label(name: str, config: dict[str, Any]) -> str:
    """The table row of a run from its ``config.json``: the paper's method name."""
    method, coder = config["method"], config["coder"]
    adaptive = "Adaptive" if coder.get("adaptive") else "Fixed"
    if method["name"] == "bicompfl_gr":
        return "GR-Adaptive-Avg" if coder["name"] == "klms_avg" else f"GR-{adaptive}"
    if method["name"] == "bicompfl_gr_reconst":
        return f"GR-Reconst-{adaptive}"
    if method["name"] == "bicompfl_pr":
        split = "-SplitDL" + ("-Hybrid" if method.get("split_rounds") else "")
        return f"PR-{adaptive}" + (split if method.get("split_downlink") else "")
    if method["name"] == "fedavg":
        return "FedAvg" if method.get("server_optimizer", "none") != "none" else "FedAvg (server lr 1)"
    for label, algorithm, _ in VARIANTS.values():
        if algorithm.split("+")[0] == method["name"]:
            return label
    return f"{method['name']}+{coder['name']}"


def _cells(run, runs) -> dict[str, Any]:
    """The paper's table (docs/papers/bicompfl.md#s5) from a run's per-round log."""
    rows, s = run["rows"], run["summary"]
    up, down = mean_of(rows, "uplink_bpp"), mean_of(rows, "downlink_bpp")
    return {
        "acc (%)": None if s.get("best_accuracy") is None else 100 * s["best_accuracy"],
        "last-5 acc (%)": None if s.get("tail_accuracy") is None else 100 * s["tail_accuracy"],
        "bpp": None if up is None else up + down,
        "bpp (BC)": mean_of(rows, "broadcast_bpp"),
        "uplink": up,
        "downlink": down,
        "rounds": str(s.get("rounds_run", len(rows))),
        **seed_cells(run),
    }


def _curve(run) -> list[tuple[float, float]]:
    """(cumulative total bits per parameter per client, test accuracy %) at each evaluation of a run."""
    total, points = 0.0, []
    for row in run["rows"]:
        total += row["uplink_bpp"] + row["downlink_bpp"]
        if row.get("test_accuracy") is not None:
            points.append((total, 100 * row["test_accuracy"]))
    return points


def plot(runs: list[dict[str, Any]], path, *, title: str | None = None):
    """Test accuracy against cumulative total bits per parameter per client (log x), one line per method,
    the mean over its seeds (solid: BICompFL, dashed: the baselines)."""

    def draw(ax, plt):
        colors = plt.get_cmap("tab20").colors
        for i, (label, group) in enumerate(by_label(runs).items()):
            xs, ys = mean_curve(group, _curve)
            if xs:
                style = "-" if group[0]["config"]["method"]["name"].startswith("bicompfl") else "--"
                color = colors[(2 * i) % 20 + (i // 10) % 2]
                ax.plot(xs, ys, style, marker=".", color=color, label=label)

    xlabel = "cumulative bits per parameter per client (uplink + downlink)"
    title = title and f"{title}: mean over seeds"
    return draw_figure(path, draw, xlabel=xlabel, ylabel="test accuracy (%)", title=title, xlog=True)


SUITE = Suite.of_module(
    globals(),
    variants=VARIANTS,
    columns=(
        "method | acc (%):.2f | last-5 acc (%):.2f | bpp:.4g | bpp (BC):.4g | uplink:.4g | "
        "downlink:.4g | rounds | seeds | runs"
    ),
    label=variant_label,
    cells=_cells,
    figure=single_figure("accuracy_vs_total_bpp.png", plot),
    per_label=True,
    preset_prefix="BICompFL ",
)

if __name__ == "__main__":  # the old command, an alias
    alias("bicompfl")
