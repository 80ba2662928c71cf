r"""BPC-FL's 1-D synthetic regression (d'Hondt, Pechenizkiy, Peharz; paper Fig. 2 and App. C.5.1 / Fig. 4;
docs/papers/bpcfl.md#s5-1, docs/papers/bpcfl.md#table-2, docs/papers/bpcfl.md#table-3,
docs/papers/bpcfl.md#table-7), against FedAvg (100 rounds) and one-shot FedAvg (1 round).

Examples::

    # the paper's Fig. 2 setting (5 clients x 100 points, sigma = 0.3), then its table
    python -m experiments.suite bpcfl_regression run results/bpcfl_regression --setting fig2 --only sigma03
    # App. C.5.1 / Fig. 4 (20 points per client), every variant, seeds 0 and 1
    python -m experiments.suite bpcfl_regression run results/bpcfl_regression_20 --setting fig4 --seeds 0 1
    # tiny settings for the tests (seconds); any field changed with --set (here the number of clients)
    python -m experiments.suite bpcfl_regression run /tmp/bpcfl_quick --setting quick --set clients=3

A **setting** (:data:`SETTINGS`) is the data: ``fig2`` (5 clients x 100 points), ``fig4`` (5 x 20) and
``quick`` (tiny settings, 5 x 12, :data:`QUICK`); a **variant** (:data:`VARIANTS`) is the likelihood and
HMC's start: ``sigma03`` (the paper's σ = 0.3, HMC from the initialisation), ``sigma1`` (σ = 1) and
``sigma1_hmc_map`` (σ = 1, HMC from the MAP estimate). One run (``<setting>_<variant>[_s<seed>]``) trains all
four methods below; :class:`RegressionConfig` holds its fields (``--set FIELD=VALUE`` changes one,
``--rounds`` is FedAvg's rounds, ``--seeds`` the seed of the data, the keys and the initialisation).

**Data** (:func:`sidejax.data.interval_regression`): ``clients`` (5) clients of ``per_client`` (100)
points; each client's interval probabilities ``~ Dirichlet([1, 1, 1])`` over the intervals
``(−0.8, −0.6), (−0.2, 0.0), (0.5, 0.8)``, ``x`` uniform inside the interval,
``y = 1.5 sin(0.4πx) + 1.5 cos(2πx) + ε``, ``ε ~ N(0, 0.3²)`` (docs/papers/bpcfl.md#s8-15: 0.3 is the std).
Test data: ``test_points`` (1,000) fresh points from the pooled mixture, and a uniform grid on
``[−1.2, 1.2]`` (``grid_points``, 241) for the predictive std and the figure.

**Model and likelihood**: the regression MLP (Dense128-swish-Dense128-swish-Dense1, P = 16,897) and a
Gaussian likelihood with std ``σ = sigma`` (0.3, docs/papers/bpcfl.md#s8-15): the loss is the masked mean of
``0.5 ((y − f) / σ)² + log σ + 0.5 log 2π``.

**Methods** (``results.json`` key: what it is):

- ``bpcfl_map``: BPC-FL with the Table 2 regression column (K = 6 per client, λ = 1e-2, σ_z = 1.0,
  ψ_x = 0.01 σ², ψ_y = 1.0 σ² (**deviation**, below), B_w = 10, S = 10, σ_ε = 1e-2, J = 100 trajectories,
  T_pre = 300 (of which r_max + L_D = 300 are used), save interval 5, pretraining batch 20, Adam 1e-2 for
  the pretraining and the inner chain, L_D = 150, L_C = 200, K_upd = 400), one round on the engine, then
  the server's Adam MAP (Table 7: lr 1e-2, 300 steps, from the network initialisation) on the aggregated
  pseudocoreset.
- ``bpcfl_hmc``: the same client phase (the same uploaded pseudocoresets: the server state's ``coreset``
  and ``weights``), then full-batch HMC on ``log p̃(θ | C)`` (Table 7: ε = 1e-3 σ (**deviation**),
  M⁻¹ = 50·I, L = 20, 200 burn-in transitions, 40 consecutive samples; started from the network
  initialisation, docs/papers/bpcfl.md#s8-10, or with ``hmc_start = "map"`` from the Adam MAP estimate on
  the same coreset, the other option there).
- **Deviation** (``steps = "unit_sigma"``, the default; ``steps = "printed"`` runs Table 2 and 7 as printed;
  docs/papers/bpcfl.md#dep-regression-sigma): the printed ψ_x, ψ_y and ε are read as steps of a
  unit-variance likelihood and rescaled to this σ (:func:`unit_sigma_steps`: ψ σ² for the gradient steps,
  ε σ for the leapfrog; at σ = 1 nothing changes). Measured at σ = 0.3, seed 0: as printed, BPC-fKL's
  label step (gain ψ_y/(Kσ²) = 1.85) diverges on 3 of 5 clients (on client 1 from the first updates:
  |∇_Z J| = 313 moves Z by 3); with ψ_y = 0.09 alone none diverges; the rescaled setting gives MAP RMSE
  0.379 against FedAvg's 0.337, and HMC's acceptance rises from 0.036 (ε = 1e-3, 157 of 240 transitions
  divergent) to 0.88.
- ``fedavg``: FedOpt (Table 3 regression: client Adam 1e-2, server Adam 0.1; 10 local steps of batch 20; all
  5 clients every round), ``fedavg_rounds`` (100) rounds from the same initialisation.
- ``fedavg_one_shot``: the same after its first round (one-shot FedAvg).
- ``dosfl`` (variants ``dosfl`` and ``dosfl_unit_sigma``, which train it alone: ``methods = "dosfl"``): DOSFL
  (:func:`sidejax.algorithms.dosfl`, docs/papers/bpcfl.md#dosfl) with Table 4's regression column (20 steps
  of 10 points, 1 epoch, SGD with momentum 0.9 at 0.1 on the inputs and labels, η̃ fixed at 0.01;
  ``DOSFL_UPDATES`` outer updates), from the same initialisation and keys; ``dosfl`` as printed,
  ``dosfl_unit_sigma`` with the three steps times σ² (:func:`unit_sigma_steps`: the steps of σ = 1). The
  report adds the distilled data and each client's real loss before and after distillation and the test RMSE
  of its own replay from θ_0.

**Metrics**, per method: ``test_rmse`` of the predictive mean on the fresh test points; ``test_nll``, the
Gaussian predictive NLL (for HMC the mixture ``(1/S) Σ_s N(y; f_s(x), σ²)``; for the point estimates
``N(y; f(x), σ²)``); on the grid, the epistemic std (std over samples of ``f_s(x)``; 0 for point
estimates) and the predictive std ``sqrt(epistemic² + σ²)`` averaged inside the intervals, in the two gaps
between them (``(−0.6, −0.2)``, ``(0.0, 0.5)``) and outside ``[−0.8, 0.8]`` (docs/papers/bpcfl.md#t15: HMC's
std must be larger in the gaps); communication measured from the engine's messages (``uplink_bits`` per client
per round, floats = bits / 32, totals over clients and rounds; downlink likewise), and wall times (including
compilation). BPC-FL also stores the learned pseudocoreset ``(Z, ŷ)`` per client with its weights, the
BPC-fKL surrogate at the first / last update and HMC's acceptance and divergences; FedAvg its test RMSE per
round and the first round (and the floats) at which it reaches BPC-FL's MAP RMSE.

Outputs in each run's folder: ``results.json`` (written last: a run without it is unfinished and starts
again), ``curves.npz`` (the sampled functions on the grid, per method) and ``predictive.png`` (Fig. 2's
style: the clients' points in colours, the true function, BPC-FL Adam MAP, BPC-FL HMC mean ± 1 and 2 std
(epistemic), FedAvg, and the pseudo-points ``(Z, ŷ)`` marked).

The suite's table (``table.md`` / ``table.csv`` in the suite's
folder) has one row per run and method: RMSE, NLL (at the model's σ and at the data's), the epistemic std
inside the intervals and in the gaps, the uplink and total floats and the wall time; ``plot`` redraws each
run's ``predictive.png`` from its files.

Measured (σ = 0.3 with the rescaled steps on seeds 0, 1 and 2; as printed and at σ = 1 on seed 0) with
what they show, and why BPC-fKL diverges at σ = 0.3 as printed: docs/papers/bpcfl.md#results-regression
and docs/papers/bpcfl.md#dep-regression-sigma; figures in ``docs/figures/bpcfl_regression*.png``
(``bpcfl_regression.png``: seed 0 with the rescaled steps; ``bpcfl_regression_printed.png``: as printed).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from experiments.sections import Section, choice, field_type, parse_word
from experiments.suite import Suite, alias

__all__ = [
    "PAPER",
    "QUICK",
    "RegressionConfig",
    "SUITE",
    "gaussian_nll_loss",
    "predictive_numbers",
    "run",
    "unit_sigma_steps",
]

GAPS = ((-0.6, -0.2), (0.0, 0.5))
GRID = (-1.2, 1.2)

#: DOSFL's outer updates per client (not in Table 4 [A], docs/papers/bpcfl.md#dosfl)
DOSFL_UPDATES = 500
# fmt: off
#: docs/papers/bpcfl.md#table-2, regression column; Table 7 (downstream) and Table 3 (FedAvg)
PAPER = dict(
    num_points=6, prior_precision=1e-2, init_std=1.0, num_updates=400, step_size_inputs=1e-2,
    step_size_labels=1.0, pairs_per_update=10, num_noise=10, noise_std=1e-2, num_trajectories=100,
    pretrain_steps=300, save_interval=5, pretrain_batch_size=20, learning_rate=1e-2, data_chain_length=150,
    coreset_chain_length=200, map_lr=1e-2, map_steps=300, hmc_step_size=1e-3, hmc_inverse_mass=50.0,
    hmc_integration_steps=20, hmc_burnin=200, hmc_samples=40, fedavg_client_lr=1e-2, fedavg_server_lr=0.1,
    fedavg_local_steps=10, fedavg_batch_size=20, fedavg_rounds=100,
    # DOSFL, docs/papers/bpcfl.md#table-4 (regression column); dosfl_updates and dosfl_init_std (BPC-FL's
    # sigma_z) are not in it (docs/papers/bpcfl.md#dosfl)
    dosfl_steps=20, dosfl_epochs=1, dosfl_batch_size=10, dosfl_input_lr=0.1, dosfl_label_lr=0.1,
    dosfl_init_lr=0.01, dosfl_updates=DOSFL_UPDATES, dosfl_init_std=1.0,
)
#: the ``quick`` setting's tiny values (a smoke run of seconds)
QUICK = dict(
    PAPER, num_points=3, num_updates=4, pairs_per_update=2, num_noise=2, num_trajectories=3,
    pretrain_steps=20, pretrain_batch_size=10, data_chain_length=10, coreset_chain_length=4, map_steps=10,
    hmc_integration_steps=3, hmc_burnin=3, hmc_samples=4, fedavg_local_steps=2, fedavg_batch_size=10,
    fedavg_rounds=3, dosfl_steps=3, dosfl_batch_size=4, dosfl_updates=5,
)
# fmt: on


@dataclasses.dataclass(frozen=True)
class RegressionConfig(Section):
    """One run of the 1-D regression (``--set FIELD=VALUE`` changes a field). Raises ``ValueError`` naming
    the first bad field (:class:`experiments.sections.Section`'s checks).

    Attributes:
      seed: the seed of the data, the keys and the network initialisation.
      quick: the :data:`QUICK` hyperparameters (a smoke run of seconds) instead of :data:`PAPER`.
      clients: the number of clients M.
      per_client: training points per client (100: Fig. 2; 20: Fig. 4); at least the pseudocoreset size K.
      sigma: the likelihood std σ of the model (docs/papers/bpcfl.md#s8-15).
      noise: the data's noise std (the test NLL is also reported at this σ).
      fedavg_rounds: FedAvg's rounds (``--rounds``).
      test_points: fresh test points from the pooled mixture.
      grid_points: grid points on [-1.2, 1.2] for the predictive std and the figure.
      steps: ``unit_sigma`` (Table 2's ψ_x, ψ_y and Table 7's ε rescaled from a unit-variance likelihood to
        ``sigma``, :func:`unit_sigma_steps`; docs/papers/bpcfl.md#dep-regression-sigma) or ``printed``.
      hmc_start: HMC's start: the network initialisation (init, docs/papers/bpcfl.md#s8-10) or the Adam MAP
        estimate on the same coreset (map).
      methods: what the run trains: bpcfl (BPC-FL's MAP and HMC, FedAvg, one-shot FedAvg) or dosfl (DOSFL
        alone, docs/papers/bpcfl.md#dosfl).
    """

    seed: int = 0
    quick: bool = False
    clients: int = 5
    per_client: int = 100
    sigma: float = 0.3
    noise: float = 0.3
    fedavg_rounds: int = 100
    test_points: int = 1000
    grid_points: int = 241
    hmc_start: str = choice("init", ("init", "map"))
    steps: str = choice("unit_sigma", ("unit_sigma", "printed"))
    methods: str = choice("bpcfl", ("bpcfl", "dosfl"))

    table: ClassVar[str] = "regression"
    limits: ClassVar = {
        ">= 0": "seed",
        ">= 1": "clients per_client fedavg_rounds test_points",
        ">= 2": "grid_points",
        "in (0, inf)": "sigma",
        "in [0, inf)": "noise",
    }

    def check(self) -> None:
        if self.per_client < (k := self.hp["num_points"]):
            raise ValueError(
                f"{self.label()}: per_client {self.per_client} is smaller than the pseudocoreset size "
                f"K = {k}: a client cannot summarise fewer points than it sends"
            )

    @property
    def hp(self) -> dict[str, Any]:
        """The hyperparameters: :data:`PAPER` (or :data:`QUICK`) with this run's FedAvg rounds; with ``steps =
        "unit_sigma"`` the printed steps are read as steps of a unit-variance likelihood and rescaled to this
        σ (:func:`unit_sigma_steps`)."""
        hp = dict(QUICK if self.quick else PAPER, fedavg_rounds=self.fedavg_rounds)
        return unit_sigma_steps(hp, self.sigma) if self.steps == "unit_sigma" else hp


def unit_sigma_steps(hp: dict[str, Any], sigma: float) -> dict[str, Any]:
    r"""``hp`` with the steps whose gain depends on the likelihood's σ rescaled from σ = 1 to ``sigma``
    (docs/papers/bpcfl.md#dep-regression-sigma): BPC-fKL's ``ψ_x``, ``ψ_y`` times ``σ²`` and HMC's leapfrog
    step ``ε`` times ``σ``; every other value unchanged (at σ = 1 nothing changes).

    Why: the Gaussian NLL is ``(y − f)²/(2σ²)`` plus a constant, so every gradient and curvature in ``(Z, ŷ)``
    scales as ``1/σ²``: a gradient step ``ψ`` at σ moves the pseudocoreset as ``ψ/σ²`` does at σ = 1. The
    label step's curvature is exactly ``1/(Kσ²)`` (mean-reduced loss), so its gain is ``g = ψ_y s/(Kσ²)``
    with ``s ≈ 1`` the inner chain's response ``∂f_C(z)/∂ŷ`` (the chain fits its labels); ``ψ_y = 1`` gives
    ``g = 1/K = 0.17`` at σ = 1 but ``1.85`` at σ = 0.3, next to the limit 2 of a stable step, and a step of
    gain ``g`` multiplies the variance of the sampled ``f_D(z)`` by ``g/(2 − g)`` (0.09 against 12.3), which
    throws ``Z`` out of the data (measured there). HMC's leapfrog frequencies ``sqrt(M⁻¹ h)`` scale as ``1/σ``
    with the likelihood's curvature ``h``, so ``εσ`` keeps ``εω`` as printed (Adam's MAP steps are invariant
    to the loss's scale and stay as printed).

    DOSFL's steps (Table 4) are SGD steps too, all times ``σ²``: the inner step ``η̃`` on a loss whose gradient
    scales as ``1/σ²``, and the outer steps on ``x̃``, ``ỹ`` along the gradient of the real NLL, which scales
    the same way; SGD with momentum is linear in the step, so DOSFL at σ with the rescaled steps takes the
    steps of DOSFL at σ = 1 as printed (docs/papers/bpcfl.md#dosfl)."""
    out = dict(hp)
    for name in ("step_size_inputs", "step_size_labels", "dosfl_input_lr", "dosfl_label_lr", "dosfl_init_lr"):
        out[name] = hp[name] * sigma**2
    out["hmc_step_size"] = hp["hmc_step_size"] * sigma
    return out


#: setting -> (description, fields of the data)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "fig2": ("paper Fig. 2: 5 clients x 100 points", {}),
    "fig4": ("paper App. C.5.1 / Fig. 4: 5 clients x 20 points", {"per_client": 20}),
    "quick": (
        "tiny settings for the tests: 5 clients x 12 points, 100 test points, 3 FedAvg rounds",
        {"quick": True, "per_client": 12, "test_points": 100, "fedavg_rounds": QUICK["fedavg_rounds"]},
    ),
}
#: variant -> (label, fields of the likelihood and HMC)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sigma03": ("sigma = 0.3 (the paper's)", {}),
    "sigma1": ("sigma = 1", {"sigma": 1.0}),
    "sigma1_hmc_map": ("sigma = 1, HMC from the MAP estimate", {"sigma": 1.0, "hmc_start": "map"}),
    "dosfl": ("DOSFL, sigma = 0.3, Table 4 as printed", {"methods": "dosfl", "steps": "printed"}),
    "dosfl_unit_sigma": (
        "DOSFL, sigma = 0.3, Table 4's steps x sigma^2 (as at sigma = 1)",
        {"methods": "dosfl"},
    ),
}
#: fields added to :class:`RegressionConfig` since runs were saved, at the value that keeps such a run as it
#: was (a saved run without the field is that run)
ADDED_DEFAULTS = {"methods": "bpcfl"}
#: results.json's methods -> their table label
METHODS = {
    "bpcfl_map": "BPC-FL + Adam MAP",
    "bpcfl_hmc": "BPC-FL + HMC",
    "fedavg": "FedAvg",
    "fedavg_one_shot": "one-shot FedAvg",
    "dosfl": "DOSFL",
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gaussian_nll_loss(apply_fn, sigma: float):
    """``loss_fn(params, Batch(x, y, mask), key)``: masked mean of ``0.5((y − f)/σ)² + log σ + 0.5 log 2π``
    with ``f = apply_fn({"params": params}, x)[:, 0]`` (the library's loss contract)."""
    from sidejax.fl.local import masked_mean

    const = math.log(sigma) + 0.5 * math.log(2.0 * math.pi)

    def loss_fn(params, batch, key):
        del key
        f = apply_fn({"params": params}, batch.x)[..., 0]
        per = 0.5 * ((batch.y - f) / sigma) ** 2 + const
        return masked_mean(per, batch.mask)

    return loss_fn


def region_masks(grid):
    """Boolean masks of the grid: inside the intervals, in the two gaps between them, outside."""
    from sidejax.data import INTERVALS

    inside = np.zeros(grid.shape, bool)
    for lo, hi in INTERVALS:
        inside |= (grid >= lo) & (grid <= hi)
    gaps = np.zeros(grid.shape, bool)
    for lo, hi in GAPS:
        gaps |= (grid > lo) & (grid < hi)
    outside = (grid < INTERVALS[0][0]) | (grid > INTERVALS[-1][1])
    return inside, gaps, outside


def _mixture_nll(f_test, y, sigma: float) -> float:
    from scipy.special import logsumexp

    logp = -0.5 * ((y[None] - f_test) / sigma) ** 2 - math.log(sigma) - 0.5 * math.log(2 * math.pi)
    return -float(np.mean(logsumexp(logp, axis=0) - math.log(f_test.shape[0])))


def predictive_numbers(f_test, y_test, f_grid, grid, sigma: float, eval_sigma: float | None = None):
    """``f_test [S, n]`` and ``f_grid [S, g]`` are the sampled means (``S = 1`` for a point estimate);
    ``test_nll`` uses the model's likelihood std ``sigma``, ``test_nll_eval_sigma`` the std ``eval_sigma``
    (default ``sigma``; the experiment passes the data's noise std, so runs with another ``--sigma`` stay
    comparable)."""
    f_test = np.asarray(f_test, np.float64)
    f_grid = np.asarray(f_grid, np.float64)
    y = np.asarray(y_test, np.float64)
    mean = f_test.mean(axis=0)
    nll = _mixture_nll(f_test, y, sigma)
    nll_eval = _mixture_nll(f_test, y, sigma if eval_sigma is None else eval_sigma)
    epi = f_grid.std(axis=0)
    pred = np.sqrt(epi**2 + sigma**2)
    inside, gaps, outside = region_masks(grid)
    rmse = float(np.sqrt(np.mean((mean - y) ** 2)))
    out = {"test_rmse": rmse, "test_nll": nll, "test_nll_eval_sigma": nll_eval}
    for name, m in (("inside", inside), ("gaps", gaps), ("outside", outside)):
        out[f"epistemic_std_{name}"] = float(epi[m].mean())
        out[f"predictive_std_{name}"] = float(pred[m].mean())
    return out


def _comm(info, num_rounds: int) -> dict[str, Any]:
    up = np.asarray(info.uplink_bits, np.float64).reshape(num_rounds, -1)
    down = np.asarray(info.downlink_bits, np.float64).reshape(num_rounds, -1)
    return {
        "rounds": num_rounds,
        "uplink_bits_per_client_round": up[0].tolist(),
        "uplink_floats_per_client_round": (up[0] / 32).tolist(),
        "uplink_floats_total": float(up.sum() / 32),
        "downlink_floats_total": float(down.sum() / 32),
        "total_floats": float((up.sum() + down.sum()) / 32),
    }


def _context(cfg: RegressionConfig):
    """The data, the model, the keys and the evaluation of one run."""
    import jax
    import jax.numpy as jnp

    from sidejax.data import interval_regression, interval_regression_test, make_federated_data
    from sidejax.keys import run_keys
    from sidejax.models import get_model, init_params

    data = interval_regression(cfg.clients, cfg.per_client, noise=cfg.noise, seed=cfg.seed)
    x_test, y_test = interval_regression_test(
        data.proportions, cfg.test_points, noise=cfg.noise, seed=cfg.seed
    )
    grid = np.linspace(*GRID, cfg.grid_points).astype(np.float32)
    spec = get_model("regression_mlp", num_classes=1, input_shape=(1,))
    apply_fn = spec.module.apply

    def init_fn(key):
        return init_params(key, spec)

    init_key, rounds_key = run_keys(cfg.seed)
    params0 = init_fn(init_key)

    @jax.jit
    def predict(samples, xs):
        return jax.vmap(lambda p: apply_fn({"params": p}, xs)[..., 0])(samples)

    x_test_j, grid_j = jnp.asarray(x_test), jnp.asarray(grid[:, None])

    def evaluate(samples):
        f_grid = np.asarray(predict(samples, grid_j))
        eval_sigma = cfg.noise if cfg.noise > 0 else None
        f_test = np.asarray(predict(samples, x_test_j))
        return predictive_numbers(f_test, y_test, f_grid, grid, cfg.sigma, eval_sigma=eval_sigma), f_grid

    return SimpleNamespace(
        data=data,
        fed=make_federated_data(data.x, data.y, data.parts),
        y_test=y_test,
        x_test_j=x_test_j,
        grid=grid,
        loss_fn=gaussian_nll_loss(apply_fn, cfg.sigma),
        init_fn=init_fn,
        init_key=init_key,
        rounds_key=rounds_key,
        params0=params0,
        num_params=int(sum(a.size for a in jax.tree.leaves(params0))),
        predict=predict,
        evaluate=evaluate,
    )


def _one_round(algo, cfg: RegressionConfig, ctx, client_map: str):
    """A one-shot method's round on the engine from the run's initialisation and keys: ``(state, info, wall
    seconds, with compilation)``."""
    import jax

    from sidejax.fl import run_rounds

    t0 = time.perf_counter()
    state0 = algo.init(ctx.init_key, ctx.params0, cfg.clients)
    state, info = run_rounds(algo, ctx.rounds_key, state0, ctx.fed, 1, client_map=client_map)
    jax.block_until_ready(state)
    return state, info, time.perf_counter() - t0


def _bpcfl_settings(hp):
    """The :class:`sidejax.algorithms.BPCFLSettings` of the hyperparameters named as its fields (Adam at
    ``learning_rate`` for the pretraining and the inner chain)."""
    import optax

    from sidejax.algorithms import BPCFLSettings

    return BPCFLSettings(
        num_classes=None,
        pretrain_optimizer=optax.adam(hp["learning_rate"]),
        chain_optimizer=optax.adam(hp["learning_rate"]),
        **{name: hp[name] for name in BPCFLSettings._fields if name in hp},
    )


def _bpcfl(cfg: RegressionConfig, ctx) -> tuple[dict[str, Any], Any]:
    """The client phase (one round on the engine) with the server's Adam MAP; returns the report's entries
    and the server state."""
    import jax
    import optax

    from sidejax.algorithms import bpcfl, map_inference

    hp = cfg.hp
    settings = ctx.settings = _bpcfl_settings(hp)
    inference = map_inference(optax.adam(hp["map_lr"]), hp["map_steps"], name="adam")
    algo = bpcfl(
        ctx.loss_fn,
        ctx.init_fn,
        input_shape=(1,),
        num_clients=cfg.clients,
        settings=settings,
        inference=inference,
    )
    _log(
        f"BPC-FL client phase: J = {settings.num_trajectories} trajectories x {settings.steps_used} steps, "
        f"K_upd = {settings.num_updates}, B_w = {settings.pairs_per_update}, L_C = "
        f"{settings.coreset_chain_length}, then Adam MAP x {hp['map_steps']} (compiling ...)"
    )
    state, info, wall = _one_round(algo, cfg, ctx, "map")
    server = state.server
    numbers, ctx.curves["bpcfl_map"] = ctx.evaluate(server.samples)
    k = settings.num_points
    z, yhat = np.asarray(server.coreset.inputs)[:, 0], np.asarray(server.coreset.labels)
    report = {
        "pseudocoreset": {
            "inputs": z.reshape(cfg.clients, k).tolist(),
            "labels": yhat.reshape(cfg.clients, k).tolist(),
            "weights": np.asarray(server.weights).reshape(cfg.clients, k)[:, 0].tolist(),
        },
        "bpcfl_diagnostics": _diagnostics(info, algo.metrics(jax.tree.map(lambda a: a[0], info))),
        "bpcfl_uplink_formula_bits": 32 * k * 1 + 32 * k + 32,
    }
    bad = [m for m in range(cfg.clients) if not np.all(np.isfinite(z.reshape(cfg.clients, k)[m]))]
    if bad or not report["bpcfl_diagnostics"]["server_finite"]:
        _log(
            f"WARNING: BPC-FL produced a non-finite pseudocoreset on client(s) {bad} (BPC-fKL diverged); the "
            f"server posterior is non-finite and the numbers below are not meaningful"
        )
    comm = ctx.comm = _comm(info, 1)
    ctx.results["bpcfl_map"] = {
        **numbers,
        **comm,
        "wall_s": wall,
        "wall_note": "client phase (pretraining + BPC-fKL) and the server's MAP, with compilation",
    }
    _log(
        f"BPC-FL + Adam MAP: RMSE {numbers['test_rmse']:.4f}, NLL {numbers['test_nll']:.4f}, uplink "
        f"{comm['uplink_floats_total']:.0f} floats, {wall:.1f} s"
    )
    return report, server


def _diagnostics(info, metrics) -> dict[str, Any]:
    extra = info.clients.extra
    return {
        "surrogate_first": np.asarray(extra.surrogate_first)[0].tolist(),
        "surrogate_last": np.asarray(extra.surrogate_last)[0].tolist(),
        "grad_norm_last": np.asarray(extra.grad_norm_last)[0].tolist(),
        "uplink_errors": np.asarray(info.uplink_errors)[0].tolist(),
        "clients_finite": bool(np.all(np.asarray(info.clients.finite))),
        "server_finite": bool(np.all(np.asarray(info.server_finite))),
        "mean_surrogate_last": float(metrics["coreset_surrogate_last"]),
    }


def _hmc(cfg: RegressionConfig, ctx, server) -> None:
    """BPC-FL + HMC on the same uploaded pseudocoresets, with the key the engine's server gives its
    inference in round 0 (``bpcfl_server_update``)."""
    import jax
    import optax

    from sidejax.algorithms import hmc_inference, map_inference
    from sidejax.algorithms.bpcfl import coreset_posterior
    from sidejax.keys import SERVER, draw_key, round_key, stream_key

    hp = cfg.hp
    start = map_inference(optax.adam(hp["map_lr"]), hp["map_steps"]) if cfg.hmc_start == "map" else None
    hmc_inf = hmc_inference(
        step_size=hp["hmc_step_size"],
        num_integration_steps=hp["hmc_integration_steps"],
        inverse_mass_matrix=hp["hmc_inverse_mass"],
        num_burnin=hp["hmc_burnin"],
        num_samples=hp["hmc_samples"],
        start=start,
    )
    hmc_key = draw_key(stream_key(round_key(ctx.rounds_key, 0), SERVER), 0)
    settings = ctx.settings

    @jax.jit
    def run_hmc(key, coreset_, weights_, init):
        return hmc_inf.run(key, coreset_posterior(ctx.loss_fn, settings, coreset_, weights_, key), init)

    _log(
        f"BPC-FL + HMC: eps = {hp['hmc_step_size']}, L = {hp['hmc_integration_steps']}, "
        f"{hp['hmc_burnin']} burn-in + {hp['hmc_samples']} samples, from {cfg.hmc_start}"
    )
    t0 = time.perf_counter()
    out = run_hmc(hmc_key, server.coreset, server.weights, server.params)
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    numbers, ctx.curves["bpcfl_hmc"] = ctx.evaluate(out.samples)
    ctx.results["bpcfl_hmc"] = {
        **numbers,
        **ctx.comm,
        "wall_s": ctx.results["bpcfl_map"]["wall_s"] + wall,
        "wall_s_hmc": wall,
        "wall_note": "the client phase (shared with bpcfl_map, incl. its MAP) plus HMC, with compilation",
        "hmc_acceptance": float(out.acceptance),
        "hmc_divergent": int(out.num_divergent),
        "hmc_finite": bool(out.finite),
    }
    _log(
        f"BPC-FL + HMC: RMSE {numbers['test_rmse']:.4f}, NLL {numbers['test_nll']:.4f}, std inside "
        f"{numbers['epistemic_std_inside']:.3f} / gaps {numbers['epistemic_std_gaps']:.3f} (epistemic), "
        f"acceptance {float(out.acceptance):.3f}, {int(out.num_divergent)} divergent, {wall:.1f} s"
    )


def _fedavg(cfg: RegressionConfig, ctx) -> None:
    """FedOpt with server Adam, one round at a time (one compilation); its first round is one-shot FedAvg."""
    import jax
    import optax

    from sidejax.algorithms import fedavg
    from sidejax.fl import LocalTraining, run_rounds

    hp = cfg.hp
    local = LocalTraining(
        optax.adam(hp["fedavg_client_lr"]),
        batch_size=hp["fedavg_batch_size"],
        num_steps=hp["fedavg_local_steps"],
    )
    algo = fedavg(
        ctx.loss_fn, local, server_optimizer=optax.adam(hp["fedavg_server_lr"]), clients_per_round=cfg.clients
    )
    _log(f"FedAvg: {hp['fedavg_rounds']} rounds, {hp['fedavg_local_steps']} local steps per round")
    t0 = time.perf_counter()
    state = algo.init(ctx.init_key, ctx.params0, cfg.clients)
    rmse_per_round, infos = [], []
    for r in range(hp["fedavg_rounds"]):
        state, info = run_rounds(algo, ctx.rounds_key, state, ctx.fed, 1, client_map="vmap")
        infos.append(info)
        samples = jax.tree.map(lambda a: a[None], algo.eval_params(state))
        f_test = np.asarray(ctx.predict(samples, ctx.x_test_j))[0]
        rmse_per_round.append(float(np.sqrt(np.mean((f_test - ctx.y_test) ** 2))))
        if r == 0:
            numbers, ctx.curves["fedavg_one_shot"] = ctx.evaluate(samples)
            ctx.results["fedavg_one_shot"] = {
                **numbers,
                **_comm(info, 1),
                "wall_s": time.perf_counter() - t0,
                "wall_note": "one round, with compilation",
            }
            _log(f"one-shot FedAvg: RMSE {numbers['test_rmse']:.4f}, NLL {numbers['test_nll']:.4f}")
        if (r + 1) % 10 == 0:
            _log(f"FedAvg round {r + 1}: test RMSE {rmse_per_round[-1]:.4f}")
    wall = time.perf_counter() - t0
    numbers, ctx.curves["fedavg"] = ctx.evaluate(samples)
    comm = _comm(
        jax.tree.map(lambda *a: np.concatenate([np.asarray(x) for x in a]), *infos), hp["fedavg_rounds"]
    )
    reach = next(
        (i + 1 for i, v in enumerate(rmse_per_round) if v <= ctx.results["bpcfl_map"]["test_rmse"]), None
    )
    per_round = comm["total_floats"] / hp["fedavg_rounds"]
    ctx.results["fedavg"] = {
        **numbers,
        **comm,
        "wall_s": wall,
        "wall_note": "all rounds, with compilation",
        "test_rmse_per_round": rmse_per_round,
        "rounds_to_bpcfl_map_rmse": reach,
        "floats_to_bpcfl_map_rmse": None if reach is None else reach * per_round,
    }
    _log(
        f"FedAvg ({hp['fedavg_rounds']} rounds): RMSE {numbers['test_rmse']:.4f}, NLL "
        f"{numbers['test_nll']:.4f}, {comm['total_floats']:.3g} floats up+down, {wall:.1f} s; reaches "
        f"BPC-FL MAP's RMSE at round {reach}"
    )


def _dosfl(cfg: RegressionConfig, ctx) -> dict[str, Any]:
    """DOSFL (docs/papers/bpcfl.md#dosfl), one round on the engine with Table 4's regression column, on the
    same initialisation and keys as BPC-FL. Returns the report's entries: the distilled data per client and
    the diagnostics that say where the one-shot model loses (each client's real loss at the start of
    distillation and for its upload; the test RMSE of each client's own replay from θ_0, the θ_final it
    distilled for, against the sequential replay's)."""
    import jax
    import optax

    from sidejax.algorithms import DOSFLSettings, dosfl
    from sidejax.algorithms.dosfl import distilled_floats, replay

    hp = cfg.hp
    momentum = functools.partial(optax.sgd, momentum=0.9)
    settings = DOSFLSettings(
        num_steps=hp["dosfl_steps"],
        num_epochs=hp["dosfl_epochs"],
        batch_size=hp["dosfl_batch_size"],
        num_updates=hp["dosfl_updates"],
        num_classes=None,
        input_optimizer=momentum(hp["dosfl_input_lr"]),
        label_optimizer=momentum(hp["dosfl_label_lr"]),
        lr_optimizer=None,  # Table 4: step size 0, eta fixed
        init_lr=hp["dosfl_init_lr"],
        init_std=hp["dosfl_init_std"],
    )
    algo = dosfl(ctx.loss_fn, input_shape=(1,), num_clients=cfg.clients, settings=settings)
    _log(
        f"DOSFL: {settings.num_steps} steps x {settings.batch_size} points x {settings.num_epochs} epoch(s), "
        f"{settings.num_updates} updates per client (compiling ...)"
    )
    state, info, wall = _one_round(algo, cfg, ctx, "vmap")
    samples = jax.tree.map(lambda a: a[None], algo.eval_params(state))
    numbers, ctx.curves["dosfl"] = ctx.evaluate(samples)
    distilled = state.server.distilled
    own = jax.jit(jax.vmap(lambda d: replay(ctx.loss_fn, ctx.params0, d, settings.num_epochs, None)))(
        distilled
    )
    f_own = np.asarray(ctx.predict(own, ctx.x_test_j))
    own_rmse = np.sqrt(np.mean((f_own - ctx.y_test[None]) ** 2, axis=1))
    extra = info.clients.extra
    ctx.results["dosfl"] = {
        **numbers,
        **_comm(info, 1),
        "wall_s": wall,
        "wall_note": "distillation on every client and the server's replay, with compilation",
    }
    report = {
        "dosfl_distilled": {
            "inputs": np.asarray(distilled.inputs).reshape(cfg.clients, -1).tolist(),
            "labels": np.asarray(distilled.labels).reshape(cfg.clients, -1).tolist(),
            "lr": np.asarray(distilled.lr).tolist(),
        },
        "dosfl_diagnostics": {
            "real_loss_first": np.asarray(extra.loss_first)[0].tolist(),
            "real_loss_last": np.asarray(extra.loss_last)[0].tolist(),
            "own_replay_test_rmse": own_rmse.tolist(),
            "clients_finite": bool(np.all(np.asarray(info.clients.finite))),
            "included": np.asarray(info.included)[0].tolist(),
        },
        "dosfl_uplink_formula_floats": cfg.clients * distilled_floats(settings, (1,)),
    }
    _log(
        f"DOSFL: RMSE {numbers['test_rmse']:.4f} (each client's own replay: "
        f"{', '.join(f'{v:.3f}' for v in own_rmse)}), real loss per client "
        f"{np.asarray(extra.loss_first)[0]} -> {np.asarray(extra.loss_last)[0]}, uplink "
        f"{ctx.results['dosfl']['uplink_floats_total']:.0f} floats, {wall:.1f} s"
    )
    return report


def run(cfg: RegressionConfig, out: Path) -> dict[str, Any]:
    """Runs the four methods of one configuration and writes ``out``'s ``curves.npz``, ``predictive.png``
    and, last, ``results.json`` (returned)."""
    import jax

    t_start = time.perf_counter()
    ctx = _context(cfg)
    ctx.results, ctx.curves = {}, {}
    mode = "quick" if cfg.quick else "paper"
    _log(f"data: {cfg.clients} clients x {cfg.per_client} points, P = {ctx.num_params}, {mode} settings")
    if cfg.methods == "dosfl":
        bpc = _dosfl(cfg, ctx)
    else:
        bpc, server = _bpcfl(cfg, ctx)
        _hmc(cfg, ctx, server)
        _fedavg(cfg, ctx)
    report = {
        "experiment": "bpcfl_regression",
        "config": dataclasses.asdict(cfg),
        **{
            k: getattr(cfg, k)
            for k in ("seed", "quick", "clients", "per_client", "sigma", "hmc_start", "noise")
        },
        "num_params": ctx.num_params,
        "client_proportions": ctx.data.proportions.tolist(),
        "test_points": cfg.test_points,
        "grid": [GRID[0], GRID[1], cfg.grid_points],
        "regions": {"gaps": GAPS, "outside": "x < -0.8 or x > 0.8"},
        "hyperparameters": cfg.hp,
        **bpc,
        "methods": {k: ctx.results[k] for k in METHODS if k in ctx.results},
        "backend": jax.default_backend(),
    }
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "curves.npz", grid=ctx.grid, **ctx.curves)
    plot(out, report, ctx.data)
    report["total_wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {out / 'results.json'} and {out / 'predictive.png'} ({report['total_wall_s']:.1f} s)")
    return report


def plot(out: Path, report: dict[str, Any], data=None) -> Path:
    """``out/predictive.png`` from ``out/curves.npz`` and the report, in Fig. 2's style: clients' points,
    truth, BPC-FL MAP, HMC mean ± 1/2 std, FedAvg, pseudo-points; for a DOSFL run its model and the distilled
    points (the data is made again from the report when not given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sidejax.data import INTERVALS, interval_regression, interval_target

    cfg = RegressionConfig(**report["config"])
    data = data or interval_regression(cfg.clients, cfg.per_client, noise=cfg.noise, seed=cfg.seed)
    curves = np.load(out / "curves.npz")
    grid = curves["grid"]
    dosfl_run = "dosfl_distilled" in report
    points = report["dosfl_distilled" if dosfl_run else "pseudocoreset"]
    z = np.asarray(points["inputs"], np.float32).reshape(-1)
    yhat = np.asarray(points["labels"], np.float32).reshape(-1)
    fig, ax = plt.subplots(figsize=(11, 5))
    colors = plt.get_cmap("tab10")
    for lo, hi in INTERVALS:
        ax.axvspan(lo, hi, color="0.93", zorder=0)
    if "bpcfl_hmc" in curves:
        mean, std = curves["bpcfl_hmc"].mean(axis=0), curves["bpcfl_hmc"].std(axis=0)
        ax.fill_between(
            grid, mean - 2 * std, mean + 2 * std, color="tab:blue", alpha=0.12, lw=0, label="HMC ± 2 std"
        )
        ax.fill_between(grid, mean - std, mean + std, color="tab:blue", alpha=0.25, lw=0, label="HMC ± 1 std")
    for m, part in enumerate(data.parts):
        ax.scatter(data.x[part, 0], data.y[part], s=9, color=colors(m), alpha=0.6, label=f"client {m}")
    ax.plot(grid, interval_target(grid), "k--", lw=1.5, label="true f(x)")
    for key, color, label in (
        ("bpcfl_hmc", "tab:blue", "BPC-FL + HMC mean"),
        ("bpcfl_map", "tab:red", "BPC-FL + Adam MAP"),
        ("fedavg", "tab:green", "FedAvg"),
        ("dosfl", "tab:purple", "DOSFL"),
    ):
        if key in curves:
            ax.plot(grid, curves[key].mean(axis=0), color=color, lw=2, label=label)
    k = len(z) // len(data.parts)
    for m in range(len(data.parts)):
        sl = slice(m * k, (m + 1) * k)
        label = ("distilled points (x̃, ỹ)" if dosfl_run else "pseudo-points (Z, ŷ)") if m == 0 else None
        ax.scatter(
            z[sl],
            yhat[sl],
            marker="x" if dosfl_run else "*",
            s=25 if dosfl_run else 160,
            color=colors(m),
            edgecolor=None if dosfl_run else "k",
            lw=0.8,
            zorder=5,
            label=label,
        )
    lo = min(np.min(data.y), np.min(yhat)) - 1.0
    hi = max(np.max(data.y), np.max(yhat)) + 1.0
    ax.set_ylim(max(lo, -10), min(hi, 10))
    ax.set_xlim(*GRID)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(
        f"{'DOSFL' if dosfl_run else 'BPC-FL'} 1-D regression: {len(data.parts)} clients x {cfg.per_client} "
        f"points, seed {cfg.seed}"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(out / "predictive.png", dpi=130)
    plt.close(fig)
    return out / "predictive.png"


# --------------------------------------------------------------------------------------------------
# the suite: settings x variants, a runner of its own (no checkpoints: an unfinished run starts again)


def suite_config(setting: str, variant: str) -> RegressionConfig:
    """The configuration of ``variant`` in ``setting``."""
    SUITE.check(setting, variant)
    return RegressionConfig(**SETTINGS[setting][1], **VARIANTS[variant][1])


class RegressionRunner:
    """How :data:`SUITE` makes and reads its runs: :func:`run` into a folder, ``results.json`` as the mark
    of a finished run (and its ``config``, what the run was asked for)."""

    def load(self, name: str) -> RegressionConfig:
        for setting in SETTINGS:
            variant = name.removeprefix(f"{SUITE.name}_{setting}_")
            if variant != name and variant in VARIANTS:
                return suite_config(setting, variant)
        raise ValueError(f"unknown {SUITE.name} run {name!r}: {SUITE.name}_<setting>_<variant>")

    def with_rounds(self, config, rounds: int):
        return dataclasses.replace(config, fedavg_rounds=rounds)

    def with_seed(self, config, seed: int):
        return dataclasses.replace(config, seed=seed)

    def with_value(self, config, key: str, text: str):
        if key not in config.field_names():
            fields = ", ".join(config.field_names())
            raise ValueError(f"--set {key}: not a field of the regression; fields: {fields}")
        kind = field_type(RegressionConfig, key)
        try:
            value = parse_word(kind.base, kind.optional, text)
        except ValueError:
            raise ValueError(f"--set {key}={text}: expected a value of type {kind.base.__name__}") from None
        return dataclasses.replace(config, **{key: value})

    def resolve(self, config, directory, seed, source):
        return config

    def plan(self, out: Path, config, force: bool) -> tuple[str, str]:
        if force or not out.exists() or not any(out.iterdir()):
            return "run", ""
        if not (out / "results.json").is_file():
            return "run", "(unfinished, and this experiment keeps no checkpoint: it starts again)"
        saved = {**ADDED_DEFAULTS, **json.loads((out / "results.json").read_text()).get("config", {})}
        asked = dataclasses.asdict(config)
        if saved == asked:
            return "skip", f"finished run found in {out}, skipped (use --force to re-run)"
        diff = {k: (v, saved.get(k)) for k, v in asked.items() if saved.get(k) != v}
        return "refuse", f"{out} holds a run of another configuration (now, saved): {diff}; use --force"

    def execute(self, config, out: Path, *, resume: bool, label: str) -> None:
        run(config, out)

    def read(self, folder: Path) -> list[dict[str, Any]]:
        if not (folder / "results.json").is_file():
            return []
        report = json.loads((folder / "results.json").read_text())
        config = report["config"]
        return [
            {"config": {**config, "method": key}, "summary": entry, "rows": [], "report": report}
            for key, entry in report["methods"].items()
        ]

    def preset_text(self, config, description: str) -> str:
        raise ValueError(
            "the 1-D regression has no preset files: its runs are made from SETTINGS x VARIANTS in "
            "experiments/bpcfl_regression.py"
        )


def _label(name: str, config: dict[str, Any]) -> str:
    method = config["method"]
    return METHODS[method] + (f" from {config['hmc_start']}" if method == "bpcfl_hmc" else "")


def _cells(run_, runs) -> dict[str, Any]:
    s, config = run_["summary"], run_["config"]
    return {
        "sigma": config["sigma"],
        "RMSE": s["test_rmse"],
        "NLL": s["test_nll"],
        "NLL at data noise": s.get("test_nll_eval_sigma"),
        "epistemic std inside": s["epistemic_std_inside"],
        "epistemic std gaps": s["epistemic_std_gaps"],
        "uplink floats": s["uplink_floats_total"],
        "total floats": s["total_floats"],
        "wall (s)": s["wall_s"],
        "run": run_["name"],
    }


def _figures(runs, directory: Path) -> list[Path]:
    folders = {r["folder"]: r["report"] for r in runs}
    return [plot(folder, report) for folder, report in folders.items()]


SUITE = Suite.of_module(
    globals(),
    title="BPC-FL's 1-D synthetic regression (paper Fig. 2) against FedAvg and one-shot FedAvg",
    variants=VARIANTS,
    columns=(
        "method | sigma:.3g | RMSE:.4f | NLL:.4g | NLL at data noise:.4g | "
        "epistemic std inside:.3g | epistemic std gaps:.3g | uplink floats:.6g | total floats:.6g | "
        "wall (s):.1f | run"
    ),
    label=_label,
    cells=_cells,
    figure=_figures,
    runner=RegressionRunner(),
)

if __name__ == "__main__":  # the old command, an alias
    alias("bpcfl_regression")
