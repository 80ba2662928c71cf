"""CEPAM experiments: the paper's settings as presets, and its accuracy / privacy / rate table from runs.

Examples (``python -m experiments.suite`` documents every command; ``presets`` rewrites the preset files
from the definitions below, which a test checks)::

    # the reduced CPU setting (Fashion-MNIST, the small CNN, 30 clients x 1,666): run every scheme, tabulate
    python -m experiments.suite cepam run results/cepam_fmnist --setting fmnist_cnn_cpu
    # only some schemes, fewer rounds (a quick look)
    python -m experiments.suite cepam run results/quick --setting fmnist_cnn_cpu --rounds 5 \
        --only fl cepam_gauss_z1

A **setting** is a dataset, model and federation (:data:`SETTINGS`): the paper's MNIST MLP (784-32-16-10,
25,818 parameters) and small CNN (6,422), 30 clients x 1,666 examples, tau = 15 single-sample steps, SGD with
momentum 0.9 at lr 0.01, 80 rounds; and the reduced CPU setting on Fashion-MNIST (the CNN, 40 rounds). MNIST
is read from local files or tensorflow-datasets (``sidejax.data``), never downloaded. A **scheme** is a row of
the paper's Tables I/II (:data:`SCHEMES`): FL, FL+SDQ, FL+Gaussian, FL+Gaussian+SDQ, CEPAM-Gaussian on Z^1,
Z^2, Z^3, and the Laplace rows. Preset ``cepam_<setting>_<scheme>``.

The table (``table.md`` / ``table.csv``) has, per scheme:

- ``acc``: the best test accuracy over the evaluations; ``final acc``: the last one;
- ``epsilon``, ``delta``: the per-round guarantee of :func:`sidejax.privacy.cepam_guarantee` for the run's
  noise level (``[coder] level``, the one the algorithm uses; with per-client levels the aggregate
  sqrt(sum sigma_k^2)/K for Gaussian, the smallest b for Laplace), at the paper's eps_tilde (5.9 Gaussian,
  5000 Laplace), tau, K, gamma and n_k; ``vacuous`` marks a delta no better than the trivial (0, p) bound
  (docs/papers/cepam.md#s6-6: the paper's own Gaussian setting is vacuous); ``-`` for schemes without noise;
- ``uplink bpp``: the measured uplink bits per parameter per client per round (the length of the actual
  streams, averaged over rounds), and ``ideal bpp`` (the encoders' ideal rate, labelled ideal).

The plot ``accuracy_vs_round.png`` shows test accuracy against the round, one line per scheme.
"""

from __future__ import annotations

import warnings
from typing import Any

from experiments.coders import MechanismConfig
from experiments.config import TABLES, ExperimentConfig, config_from_dict, default_config
from experiments.suite import (
    Suite,
    alias,
    by_label,
    draw_figure,
    mean_by_round,
    mean_of,
    seed_cells,
    single_figure,
)
from sidejax import privacy

__all__ = ["SETTINGS", "SCHEMES", "SUITE", "suite_config", "guarantee"]

_FED = {
    "data.num_clients": 30,
    "data.participation": 1.0,
    "data.partition": "fixed",
    "data.examples_per_client": 1666,
}
_RUN = {"run.rounds": 80, "run.eval_every": 5, "run.eval_batch_size": 2000, "run.client_strategy": "auto"}

#: setting -> (description, dotted overrides of [run] and [data])
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mnist_mlp": (
        "paper Tables I/II: MNIST, MLP 784-32-16-10, 30 clients x 1,666, tau = 15, 80 rounds",
        {**_RUN, **_FED, "data.dataset": "mnist", "data.model": "mlp_32_16"},
    ),
    "mnist_cnn": (
        "paper Tables I/II: MNIST, the small CNN (6,422 parameters), 30 clients x 1,666, tau = 15, 80 rounds",
        {**_RUN, **_FED, "data.dataset": "mnist", "data.model": "cepam_cnn"},
    ),
    "fmnist_cnn_cpu": (
        "reduced CPU setting: Fashion-MNIST, the small CNN, 30 clients x 1,666, tau = 15, 40 rounds",
        {**_RUN, **_FED, "run.rounds": 40, "data.dataset": "fashion_mnist", "data.model": "cepam_cnn"},
    ),
}

_SIGMA = 0.1  # the paper's sigma = b = 0.1 (Var = n sigma^2, 2 b^2)
_SDQ_STEP = 1e-3  # the paper-like fine SDQ step (docs/papers/cepam.md#s3)


def _noise(noise: str, **extra: Any) -> dict[str, Any]:
    return {"coder.noise": noise, "coder.level": [_SIGMA], **extra}


#: scheme -> (table label, coder name, coder overrides)
SCHEMES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "fl": ("FL", "float32", {}),
    "fl_sdq": ("FL+SDQ", "sdq", {"coder.step": _SDQ_STEP}),
    "fl_gauss": ("FL+Gaussian", "noise", _noise("gauss")),
    "fl_gauss_sdq": ("FL+Gaussian+SDQ", "noise", _noise("gauss", **{"coder.sdq_step": _SDQ_STEP})),
    "cepam_gauss_z1": ("CEPAM-Gaussian (n=1)", "lrsuq", _noise("gauss", **{"coder.lattice": "z1"})),
    "cepam_gauss_z2": ("CEPAM-Gaussian (n=2)", "lrsuq", _noise("gauss", **{"coder.lattice": "z2"})),
    "cepam_gauss_z3": ("CEPAM-Gaussian (n=3)", "lrsuq", _noise("gauss", **{"coder.lattice": "z3"})),
    "fl_laplace": ("FL+Laplace", "noise", _noise("laplace")),
    "fl_laplace_sdq": ("FL+Laplace+SDQ", "noise", _noise("laplace", **{"coder.sdq_step": _SDQ_STEP})),
    "cepam_laplace": ("CEPAM-Laplace", "lrsuq", _noise("laplace", **{"coder.lattice": "z1"})),
}

#: the paper's eps_tilde of each noise family (docs/papers/cepam.md#s3)
EPS_TILDE = {"gauss": 5.9, "laplace": 5000.0}


def suite_config(setting: str, scheme: str) -> ExperimentConfig:
    """The configuration of ``scheme`` in ``setting`` (preset ``cepam_<setting>_<scheme>``)."""
    SUITE.check(setting, scheme)
    _, values = SETTINGS[setting]
    _, coder, extra = SCHEMES[scheme]
    name = SUITE.preset_name(setting, scheme)
    return default_config(f"cepam+{coder}").override({**values, **extra}, source=name)


def _typed(config: dict[str, Any]) -> ExperimentConfig:
    """The configuration of a run's ``config.json`` (one written before the noise level had one home is
    converted, :func:`experiments.config.config_from_dict`)."""
    return config_from_dict({t: config[t] for t in TABLES if t in config}, source="config.json")


def guarantee(config: dict[str, Any]) -> privacy.PrivacyGuarantee | None:
    """The per-round guarantee of a run from its ``config.json`` (None for a scheme without noise): the
    noise level is the coder's ``level``, the one the algorithm uses (one per client when it has several)."""
    cfg = _typed(config)
    coder = cfg.coder
    if not isinstance(coder, MechanismConfig):
        return None
    setting = privacy.CepamSetting(
        tau=cfg.method.local_steps,
        n_k=cfg.data.examples_per_client,
        gamma=coder.gamma,
        num_clients=cfg.data.num_clients,
        clip_mode="paper" if coder.clip == "normalise" else "dp",
    )
    levels = coder.client_levels(cfg.data.num_clients)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", privacy.VacuousPrivacyWarning)  # reported in the table instead
        if coder.noise == "gauss":
            return privacy.cepam_guarantee(
                "gaussian",
                # K levels: sqrt(sum sigma_k^2)/K (docs/papers/cepam.md#s2-12)
                coder.level[0] if levels is None else levels,
                EPS_TILDE[coder.noise],
                setting,
            )
        # Laplace: the per-client guarantee of the client with the least noise
        b = coder.level[0] if levels is None else min(levels)
        return privacy.cepam_guarantee("laplace", b, EPS_TILDE[coder.noise], setting)


def _label(name: str, config: dict[str, Any]) -> str:
    # the most specific scheme first (FL+Gaussian+SDQ before FL+Gaussian)
    flat = _typed(config).flat()
    for label, coder, extra in sorted(SCHEMES.values(), key=lambda v: -len(v[2])):
        if coder == flat["coder.name"] and all(flat.get(k) == v for k, v in extra.items()):
            return label
    return f"cepam+{config['coder']['name']}"


def _cells(run, runs) -> dict[str, Any]:
    rows, s, g = run["rows"], run["summary"], run["g"]
    ideal = s.get("mean_uplink_ideal_bpp")
    return {
        "acc (%)": None if s.get("best_accuracy") is None else 100 * s["best_accuracy"],
        "final acc (%)": None if s.get("final_accuracy") is None else 100 * s["final_accuracy"],
        "epsilon": None if g is None else g.epsilon,
        "delta": None if g is None else g.delta,
        "vacuous": "-" if g is None else ("yes" if g.vacuous else "no"),
        "uplink bpp": mean_of(rows, "uplink_bpp"),
        "ideal bpp": None if ideal is None or ideal != ideal else ideal,
        "rounds": str(s.get("rounds_run", len(rows))),
        **seed_cells(run),
    }


def plot(runs: list[dict[str, Any]], path, *, title: str | None = None):
    """Test accuracy against the round, one line per scheme, the mean over its seeds (solid: CEPAM, dashed:
    the baselines)."""

    def draw(ax, plt):
        for label, group in by_label(runs).items():
            common, mean = mean_by_round(group, "test_accuracy")
            if common:
                ax.plot(common, mean, "-" if label.startswith("CEPAM") else "--", marker=".", label=label)

    title = title and f"{title}: mean over seeds"
    return draw_figure(path, draw, xlabel="round", ylabel="test accuracy (%)", title=title)


SUITE = Suite.of_module(
    globals(),
    variants=SCHEMES,
    columns=(
        "scheme | acc (%):.2f | final acc (%):.2f | epsilon:.6g | delta:.4g | vacuous | "
        "uplink bpp:.4g | ideal bpp:.4g | rounds | seeds | runs"
    ),
    label=_label,
    cells=_cells,
    figure=single_figure("accuracy_vs_round.png", plot),
    per_label=True,
    noun="schemes",
    preset_prefix="CEPAM ",
    annotate=lambda config: {"g": guarantee(config)},
)

if __name__ == "__main__":  # the old command, an alias
    alias("cepam")
