r"""BPC-FL's 1-D synthetic regression (d'Hondt, Pechenizkiy, Peharz; paper Fig. 2 and App. C.5.1 / Fig. 4;
docs/papers/bpcfl.md#s5-1, docs/papers/bpcfl.md#table-2, docs/papers/bpcfl.md#table-3,
docs/papers/bpcfl.md#table-7), against FedAvg (100 rounds) and one-shot FedAvg (1 round).

Examples::

    # the paper's Fig. 2 setting (5 clients x 100 points), results in results/bpcfl_regression
    python -m experiments.bpcfl_regression
    # App. C.5.1 / Fig. 4: 20 points per client
    python -m experiments.bpcfl_regression --per-client 20 --out results/bpcfl_regression_20
    # tiny settings for the tests (seconds)
    python -m experiments.bpcfl_regression --quick --out /tmp/bpcfl_quick

**Data** (:func:`sidejax.data.interval_regression`): ``--clients`` (5) clients of ``--per-client`` (100)
points; each client's interval probabilities ``~ Dirichlet([1, 1, 1])`` over the intervals
``(−0.8, −0.6), (−0.2, 0.0), (0.5, 0.8)``, ``x`` uniform inside the interval,
``y = 1.5 sin(0.4πx) + 1.5 cos(2πx) + ε``, ``ε ~ N(0, 0.3²)`` (docs/papers/bpcfl.md#s8-15: 0.3 is the std).
Test data: ``--test-points`` (1,000) fresh points from the pooled mixture, and a uniform grid on
``[−1.2, 1.2]`` (``--grid-points``, 241) for the predictive std and the figure.

**Model and likelihood**: the regression MLP (Dense128-swish-Dense128-swish-Dense1, P = 16,897) and a
Gaussian likelihood with std ``σ = --sigma`` (0.3, docs/papers/bpcfl.md#s8-15): the loss is the masked mean of
``0.5 ((y − f) / σ)² + log σ + 0.5 log 2π``.

**Methods** (``results.json`` key: what it is):

- ``bpcfl_map``: BPC-FL with the Table 2 regression column (K = 6 per client, λ = 1e-2, σ_z = 1.0,
  ψ_x = 0.01, ψ_y = 1.0, B_w = 10, S = 10, σ_ε = 1e-2, J = 100 trajectories, T_pre = 300 (of which
  r_max + L_D = 300 are used), save interval 5, pretraining batch 20, Adam 1e-2 for the pretraining and the
  inner chain, L_D = 150, L_C = 200, K_upd = 400), one round on the engine, then the server's Adam MAP
  (Table 7: lr 1e-2, 300 steps, from the network initialisation) on the aggregated pseudocoreset.
- ``bpcfl_hmc``: the same client phase (the same uploaded pseudocoresets: the server state's ``coreset``
  and ``weights``), then full-batch HMC on ``log p̃(θ | C)`` (Table 7: ε = 1e-3, M⁻¹ = 50·I, L = 20,
  200 burn-in transitions, 40 consecutive samples; started from the network initialisation,
  docs/papers/bpcfl.md#s8-10, or with ``--hmc-start map`` from the Adam MAP estimate on the same coreset, the
  other option there).
- ``fedavg``: FedOpt (Table 3 regression: client Adam 1e-2, server Adam 0.1; 10 local steps of batch 20; all
  5 clients every round), ``--fedavg-rounds`` (100) rounds from the same initialisation.
- ``fedavg_one_shot``: the same after its first round (one-shot FedAvg).

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

Outputs in ``--out`` (default ``results/bpcfl_regression``; ``results/`` is not committed): ``results.json``,
``curves.npz`` (the sampled functions on the grid, per method) and ``predictive.png`` (Fig. 2's style: the
clients' points in colours, the true function, BPC-FL Adam MAP, BPC-FL HMC mean ± 1 and 2 std (epistemic),
FedAvg, and the pseudo-points ``(Z, ŷ)`` marked).

Measured (seed 0, 5 x 100 points, the loaded 2-core CPU, wall times with compilation; figures in
``docs/figures/bpcfl_regression*.png``; the HMC rows with HMC's key drawn outside the key schedule, before it
moved to the engine server's inference key: the same law, other draws). RMSE / NLL on 1,000 fresh test
points; NLL at the data's σ = 0.3:

::

    σ = 0.3 (docs/papers/bpcfl.md#s8-15; Tables 2 and 7)   RMSE    NLL     uplink floats (total)  wall
      BPC-FL + Adam MAP                                     nan     nan     65                     523 s
      BPC-FL + HMC (from init)                              1.476   11.82   65                     +4 s
      FedAvg, 100 rounds                                    0.337   0.345   8,448,500 (+ same down) 5 s
      one-shot FedAvg                                       0.939   4.61    84,485 (+ same down)   5 s
    σ = 1.0 (extra variant; NLL at σ = 0.3 in brackets)
      BPC-FL + Adam MAP                                     0.723   1.18 (2.62)                    565 s
      BPC-FL + HMC from init                                0.990   1.41 (5.15)   acc 0.12, 106/240 divergent
      BPC-FL + HMC from MAP (--hmc-start map)               0.970   1.39 (4.65)   acc 0.15, 86/240 divergent
      FedAvg, 100 rounds                                    0.362   0.98 (0.44)   reaches 0.723 at round 15
      one-shot FedAvg                                       0.939   1.36 (4.61)

With σ = 0.3 BPC-fKL diverges on 3 of 5 clients (pseudo-inputs at ~1e9 on one, NaN on another; the two
others decrease the surrogate), so the server posterior is NaN: MAP is NaN and every HMC transition is
divergent (the samples are the network initialisation). A likely cause: ``∂ℓ̄/∂ŷ = (ŷ − f)/(σ² K)``, so the
label step ψ_y = 1 has gain ``ψ_y / (σ² K) = 1.85`` at σ = 0.3, K = 6 (close to the stability limit 2 of a
gradient step when the inner chain fits the labels), against 0.17 at σ = 1: the paper's step sizes fit a
unit-variance likelihood (or MSE). With σ = 1 every client converges (surrogate 0.11-5.0 → 0.04-0.07), the
uplink is 13 floats per client (416 bits, the stream formula), but the MAP fit is still much worse than 100
rounds of FedAvg (it misses the right interval), HMC with Table 7's step (1e-3, M⁻¹ = 50) hardly moves
(acceptance 0.12-0.15; from init the 40 kept samples are identical), and its epistemic std is small:
0.063 inside the intervals, 0.096 in the gaps (from MAP; T15's ordering holds but the bands are narrow).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_OUT = Path("results/bpcfl_regression")
GAPS = ((-0.6, -0.2), (0.0, 0.5))
GRID = (-1.2, 1.2)

#: docs/papers/bpcfl.md#table-2, regression column (the --quick values beside them)
PAPER = dict(
    num_points=6,
    prior_precision=1e-2,
    init_std=1.0,
    num_updates=400,
    step_size_inputs=1e-2,
    step_size_labels=1.0,
    pairs_per_update=10,
    num_noise=10,
    noise_std=1e-2,
    num_trajectories=100,
    pretrain_steps=300,
    save_interval=5,
    pretrain_batch_size=20,
    learning_rate=1e-2,
    data_chain_length=150,
    coreset_chain_length=200,
    # Table 7 (downstream) and Table 3 (FedAvg)
    map_lr=1e-2,
    map_steps=300,
    hmc_step_size=1e-3,
    hmc_inverse_mass=50.0,
    hmc_integration_steps=20,
    hmc_burnin=200,
    hmc_samples=40,
    fedavg_client_lr=1e-2,
    fedavg_server_lr=0.1,
    fedavg_local_steps=10,
    fedavg_batch_size=20,
    fedavg_rounds=100,
)
QUICK = dict(
    PAPER,
    num_points=3,
    num_updates=4,
    pairs_per_update=2,
    num_noise=2,
    num_trajectories=3,
    pretrain_steps=20,
    pretrain_batch_size=10,
    data_chain_length=10,
    coreset_chain_length=4,
    map_steps=10,
    hmc_integration_steps=3,
    hmc_burnin=3,
    hmc_samples=4,
    fedavg_local_steps=2,
    fedavg_batch_size=10,
    fedavg_rounds=3,
)


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
    import numpy as np

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
    import numpy as np

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bpcfl_regression",
        description="BPC-FL's 1-D synthetic regression (paper Fig. 2) against FedAvg and one-shot FedAvg.",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default %(default)s)")
    p.add_argument(
        "--overwrite", action="store_true", help="write into --out even if it holds files (a finished result)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the keys and the init")
    p.add_argument("--quick", action="store_true", help="tiny settings for tests (seconds)")
    p.add_argument("--clients", type=int, default=5, help="number of clients M (default 5)")
    p.add_argument("--per-client", type=int, default=None, help="points per client (100; 20: Fig. 4)")
    p.add_argument("--sigma", type=float, default=0.3, help="likelihood std (default 0.3)")
    p.add_argument("--noise", type=float, default=0.3, help="data noise std (default 0.3)")
    p.add_argument("--fedavg-rounds", type=int, default=None, help="FedAvg rounds (default 100)")
    p.add_argument("--test-points", type=int, default=None, help="fresh test points (default 1000)")
    p.add_argument("--grid-points", type=int, default=241, help="grid points on [-1.2, 1.2]")
    p.add_argument(
        "--hmc-start",
        choices=("init", "map"),
        default="init",
        help="HMC's start: the network initialisation (default, docs/papers/bpcfl.md#s8-10) or the Adam MAP "
        "estimate",
    )
    return p


def _check_args(args, hp) -> str | None:
    """The first problem with the arguments, as one line (``None``: fine)."""
    for name in ("clients", "per_client", "fedavg_rounds", "test_points", "grid_points"):
        value = getattr(args, name)
        if value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    if args.grid_points < 2:
        return f"--grid-points must be >= 2, got {args.grid_points}"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    for name in ("sigma", "noise"):
        value = getattr(args, name)
        if not (math.isfinite(value) and (value > 0 if name == "sigma" else value >= 0)):
            return f"--{name} must be a finite number {'> 0' if name == 'sigma' else '>= 0'}, got {value}"
    if args.per_client < hp["num_points"]:
        return (
            f"--per-client {args.per_client} is smaller than the pseudocoreset size K = {hp['num_points']}: "
            f"a client cannot summarise fewer points than it sends"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    hp = dict(QUICK if args.quick else PAPER)
    if args.per_client is None:
        args.per_client = 12 if args.quick else 100
    if args.fedavg_rounds is None:
        args.fedavg_rounds = hp["fedavg_rounds"]
    if args.test_points is None:
        args.test_points = 100 if args.quick else 1000
    problem = _check_args(args, hp)
    if problem is not None:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    from experiments.driver import check_new_output

    try:  # before any work: a finished result is not overwritten unless asked
        check_new_output(args.out, overwrite=args.overwrite, flag="--out")
    except (ValueError, FileExistsError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    hp["fedavg_rounds"] = args.fedavg_rounds
    return run(args, hp)


def run(args, hp: dict[str, Any]) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from sidejax.algorithms import BPCFLSettings, bpcfl, fedavg, hmc_inference, map_inference
    from sidejax.algorithms.bpcfl import coreset_posterior
    from sidejax.data import interval_regression, interval_regression_test, make_federated_data
    from sidejax.fl import LocalTraining, run_rounds
    from sidejax.keys import SERVER, draw_key, round_key, run_keys, stream_key
    from sidejax.models import get_model, init_params

    t_start = time.perf_counter()
    out = Path(args.out)
    sigma = float(args.sigma)
    data = interval_regression(args.clients, args.per_client, noise=args.noise, seed=args.seed)
    x_test, y_test = interval_regression_test(
        data.proportions, args.test_points, noise=args.noise, seed=args.seed
    )
    grid = np.linspace(*GRID, args.grid_points).astype(np.float32)
    fed = make_federated_data(data.x, data.y, data.parts)
    spec = get_model("regression_mlp", num_classes=1, input_shape=(1,))
    apply_fn = spec.module.apply
    loss_fn = gaussian_nll_loss(apply_fn, sigma)

    def init_fn(key):
        return init_params(key, spec)

    init_key, rounds_key = run_keys(args.seed)
    params0 = init_fn(init_key)
    num_params = int(sum(a.size for a in jax.tree.leaves(params0)))
    _log(
        f"data: {args.clients} clients x {args.per_client} points, P = {num_params}, "
        f"{'quick' if args.quick else 'paper'} settings"
    )

    @jax.jit
    def predict(samples, xs):
        return jax.vmap(lambda p: apply_fn({"params": p}, xs)[..., 0])(samples)

    x_test_j, grid_j = jnp.asarray(x_test), jnp.asarray(grid[:, None])

    def evaluate(samples):
        return predictive_numbers(
            np.asarray(predict(samples, x_test_j)),
            y_test,
            np.asarray(predict(samples, grid_j)),
            grid,
            sigma,
            eval_sigma=args.noise if args.noise > 0 else None,
        ), np.asarray(predict(samples, grid_j))

    results: dict[str, Any] = {}
    curves: dict[str, np.ndarray] = {}

    # --- BPC-FL: the client phase (one round on the engine) with the server's Adam MAP ----------------------
    settings = BPCFLSettings(
        num_points=hp["num_points"],
        num_classes=None,
        prior_precision=hp["prior_precision"],
        init_std=hp["init_std"],
        num_updates=hp["num_updates"],
        step_size_inputs=hp["step_size_inputs"],
        step_size_labels=hp["step_size_labels"],
        pairs_per_update=hp["pairs_per_update"],
        num_noise=hp["num_noise"],
        noise_std=hp["noise_std"],
        num_trajectories=hp["num_trajectories"],
        pretrain_steps=hp["pretrain_steps"],
        pretrain_batch_size=hp["pretrain_batch_size"],
        pretrain_optimizer=optax.adam(hp["learning_rate"]),
        chain_optimizer=optax.adam(hp["learning_rate"]),
        data_chain_length=hp["data_chain_length"],
        coreset_chain_length=hp["coreset_chain_length"],
        save_interval=hp["save_interval"],
    )
    algo = bpcfl(
        loss_fn,
        init_fn,
        input_shape=(1,),
        num_clients=args.clients,
        settings=settings,
        inference=map_inference(optax.adam(hp["map_lr"]), hp["map_steps"], name="adam"),
    )
    _log(
        f"BPC-FL client phase: J = {settings.num_trajectories} trajectories x {settings.steps_used} steps, "
        f"K_upd = {settings.num_updates}, B_w = {settings.pairs_per_update}, L_C = "
        f"{settings.coreset_chain_length}, then Adam MAP x {hp['map_steps']} (compiling ...)"
    )
    t0 = time.perf_counter()
    state0 = algo.init(init_key, params0, args.clients)
    state, info = run_rounds(algo, rounds_key, state0, fed, 1, client_map="map")
    jax.block_until_ready(state)
    t_bpcfl = time.perf_counter() - t0
    server = state.server
    metrics = algo.metrics(jax.tree.map(lambda a: a[0], info))
    comm = _comm(info, 1)
    numbers, curves["bpcfl_map"] = evaluate(server.samples)
    z = np.asarray(server.coreset.inputs)[:, 0]
    yhat = np.asarray(server.coreset.labels)
    w = np.asarray(server.weights)
    k = settings.num_points
    coreset = {
        "inputs": z.reshape(args.clients, k).tolist(),
        "labels": yhat.reshape(args.clients, k).tolist(),
        "weights": w.reshape(args.clients, k)[:, 0].tolist(),
    }
    diagnostics = {
        "surrogate_first": np.asarray(info.clients.extra.surrogate_first)[0].tolist(),
        "surrogate_last": np.asarray(info.clients.extra.surrogate_last)[0].tolist(),
        "grad_norm_last": np.asarray(info.clients.extra.grad_norm_last)[0].tolist(),
        "uplink_errors": np.asarray(info.uplink_errors)[0].tolist(),
        "clients_finite": bool(np.all(np.asarray(info.clients.finite))),
        "server_finite": bool(np.all(np.asarray(info.server_finite))),
        "mean_surrogate_last": float(metrics["coreset_surrogate_last"]),
    }
    bad = [m for m in range(args.clients) if not np.all(np.isfinite(z.reshape(args.clients, k)[m]))]
    if bad or not diagnostics["server_finite"]:
        _log(
            f"WARNING: BPC-FL produced a non-finite pseudocoreset on client(s) {bad} (BPC-fKL diverged); the "
            f"server posterior is non-finite and the numbers below are not meaningful"
        )
    results["bpcfl_map"] = {
        **numbers,
        **comm,
        "wall_s": t_bpcfl,
        "wall_note": "client phase (pretraining + BPC-fKL) and the server's MAP, with compilation",
    }
    _log(
        f"BPC-FL + Adam MAP: RMSE {numbers['test_rmse']:.4f}, NLL {numbers['test_nll']:.4f}, uplink "
        f"{comm['uplink_floats_total']:.0f} floats, {t_bpcfl:.1f} s"
    )

    # --- BPC-FL + HMC on the same uploaded pseudocoresets ---------------------------------------------------
    hmc_inf = hmc_inference(
        step_size=hp["hmc_step_size"],
        num_integration_steps=hp["hmc_integration_steps"],
        inverse_mass_matrix=hp["hmc_inverse_mass"],
        num_burnin=hp["hmc_burnin"],
        num_samples=hp["hmc_samples"],
        start=map_inference(optax.adam(hp["map_lr"]), hp["map_steps"]) if args.hmc_start == "map" else None,
    )
    # the key the engine's server gives its inference in round 0 (bpcfl_server_update)
    hmc_key = draw_key(stream_key(round_key(rounds_key, 0), SERVER), 0)

    @jax.jit
    def run_hmc(key, coreset_, weights_, init):
        logdensity = coreset_posterior(loss_fn, settings, coreset_, weights_, key)
        return hmc_inf.run(key, logdensity, init)

    _log(
        f"BPC-FL + HMC: eps = {hp['hmc_step_size']}, L = {hp['hmc_integration_steps']}, "
        f"{hp['hmc_burnin']} burn-in + {hp['hmc_samples']} samples, from {args.hmc_start}"
    )
    t0 = time.perf_counter()
    hmc_out = run_hmc(hmc_key, server.coreset, server.weights, server.params)
    jax.block_until_ready(hmc_out)
    t_hmc = time.perf_counter() - t0
    numbers, curves["bpcfl_hmc"] = evaluate(hmc_out.samples)
    results["bpcfl_hmc"] = {
        **numbers,
        **comm,
        "wall_s": t_bpcfl + t_hmc,
        "wall_s_hmc": t_hmc,
        "wall_note": "the client phase (shared with bpcfl_map, incl. its MAP) plus HMC, with compilation",
        "hmc_acceptance": float(hmc_out.acceptance),
        "hmc_divergent": int(hmc_out.num_divergent),
        "hmc_finite": bool(hmc_out.finite),
    }
    _log(
        f"BPC-FL + HMC: RMSE {numbers['test_rmse']:.4f}, NLL {numbers['test_nll']:.4f}, std inside "
        f"{numbers['epistemic_std_inside']:.3f} / gaps {numbers['epistemic_std_gaps']:.3f} (epistemic), "
        f"acceptance {float(hmc_out.acceptance):.3f}, {int(hmc_out.num_divergent)} divergent, {t_hmc:.1f} s"
    )

    # --- FedAvg (FedOpt with server Adam), one round at a time (one compilation) ----------------------------
    fed_algo = fedavg(
        loss_fn,
        LocalTraining(
            optax.adam(hp["fedavg_client_lr"]),
            batch_size=hp["fedavg_batch_size"],
            num_steps=hp["fedavg_local_steps"],
        ),
        server_optimizer=optax.adam(hp["fedavg_server_lr"]),
        clients_per_round=args.clients,
    )
    _log(f"FedAvg: {hp['fedavg_rounds']} rounds, {hp['fedavg_local_steps']} local steps per round")
    t0 = time.perf_counter()
    fstate = fed_algo.init(init_key, params0, args.clients)
    rmse_per_round, infos = [], []
    t_one = None
    for r in range(hp["fedavg_rounds"]):
        fstate, finfo = run_rounds(fed_algo, rounds_key, fstate, fed, 1, client_map="vmap")
        infos.append(finfo)
        samples = jax.tree.map(lambda a: a[None], fed_algo.eval_params(fstate))
        rmse = float(np.sqrt(np.mean((np.asarray(predict(samples, x_test_j))[0] - y_test) ** 2)))
        rmse_per_round.append(rmse)
        if r == 0:
            t_one = time.perf_counter() - t0
            numbers, curves["fedavg_one_shot"] = evaluate(samples)
            results["fedavg_one_shot"] = {
                **numbers,
                **_comm(finfo, 1),
                "wall_s": t_one,
                "wall_note": "one round, with compilation",
            }
            _log(f"one-shot FedAvg: RMSE {numbers['test_rmse']:.4f}, NLL {numbers['test_nll']:.4f}")
        if (r + 1) % 10 == 0:
            _log(f"FedAvg round {r + 1}: test RMSE {rmse:.4f}")
    t_fed = time.perf_counter() - t0
    all_info = jax.tree.map(lambda *a: np.concatenate([np.asarray(x) for x in a]), *infos)
    numbers, curves["fedavg"] = evaluate(samples)
    fed_comm = _comm(all_info, hp["fedavg_rounds"])
    target = results["bpcfl_map"]["test_rmse"]
    reach = next((i + 1 for i, v in enumerate(rmse_per_round) if v <= target), None)
    per_round_floats = fed_comm["total_floats"] / hp["fedavg_rounds"]
    results["fedavg"] = {
        **numbers,
        **fed_comm,
        "wall_s": t_fed,
        "wall_note": "all rounds, with compilation",
        "test_rmse_per_round": rmse_per_round,
        "rounds_to_bpcfl_map_rmse": reach,
        "floats_to_bpcfl_map_rmse": None if reach is None else reach * per_round_floats,
    }
    _log(
        f"FedAvg ({hp['fedavg_rounds']} rounds): RMSE {numbers['test_rmse']:.4f}, NLL "
        f"{numbers['test_nll']:.4f}, {fed_comm['total_floats']:.3g} floats up+down, {t_fed:.1f} s; reaches "
        f"BPC-FL MAP's RMSE at round {reach}"
    )

    # --- outputs --------------------------------------------------------------------------------------------
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "experiment": "bpcfl_regression",
        "argv": sys.argv[1:] if __name__ == "__main__" else None,
        "seed": args.seed,
        "quick": bool(args.quick),
        "clients": args.clients,
        "per_client": args.per_client,
        "sigma": sigma,
        "hmc_start": args.hmc_start,
        "noise": args.noise,
        "num_params": num_params,
        "client_proportions": data.proportions.tolist(),
        "test_points": args.test_points,
        "grid": [GRID[0], GRID[1], args.grid_points],
        "regions": {"gaps": GAPS, "outside": "x < -0.8 or x > 0.8"},
        "hyperparameters": hp,
        "bpcfl_uplink_formula_bits": 32 * k * 1 + 32 * k + 32,
        "pseudocoreset": coreset,
        "bpcfl_diagnostics": diagnostics,
        "methods": results,
        "backend": jax.default_backend(),
        "total_wall_s": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    np.savez(out / "curves.npz", grid=grid, **curves)
    plot(out / "predictive.png", data, grid, curves, z, yhat, args)
    _log(f"wrote {out / 'results.json'} and {out / 'predictive.png'} ({report['total_wall_s']:.1f} s)")
    return 0


def plot(path: Path, data, grid, curves, z, yhat, args) -> None:
    """Fig. 2's style: clients' points, truth, BPC-FL MAP, HMC mean ± 1/2 std, FedAvg, pseudo-points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from sidejax.data import INTERVALS, interval_target

    fig, ax = plt.subplots(figsize=(11, 5))
    colors = plt.get_cmap("tab10")
    for lo, hi in INTERVALS:
        ax.axvspan(lo, hi, color="0.93", zorder=0)
    hmc = curves["bpcfl_hmc"]
    mean, std = hmc.mean(axis=0), hmc.std(axis=0)
    ax.fill_between(
        grid, mean - 2 * std, mean + 2 * std, color="tab:blue", alpha=0.12, lw=0, label="HMC ± 2 std"
    )
    ax.fill_between(grid, mean - std, mean + std, color="tab:blue", alpha=0.25, lw=0, label="HMC ± 1 std")
    for m, part in enumerate(data.parts):
        ax.scatter(data.x[part, 0], data.y[part], s=9, color=colors(m), alpha=0.6, label=f"client {m}")
    ax.plot(grid, interval_target(grid), "k--", lw=1.5, label="true f(x)")
    ax.plot(grid, mean, color="tab:blue", lw=2, label="BPC-FL + HMC mean")
    ax.plot(grid, curves["bpcfl_map"][0], color="tab:red", lw=2, label="BPC-FL + Adam MAP")
    ax.plot(grid, curves["fedavg"][0], color="tab:green", lw=1.5, label="FedAvg")
    k = len(z) // len(data.parts)
    for m in range(len(data.parts)):
        sl = slice(m * k, (m + 1) * k)
        ax.scatter(
            z[sl],
            yhat[sl],
            marker="*",
            s=160,
            color=colors(m),
            edgecolor="k",
            lw=0.8,
            zorder=5,
            label="pseudo-points (Z, ŷ)" if m == 0 else None,
        )
    lo = min(np.min(data.y), np.min(yhat)) - 1.0
    hi = max(np.max(data.y), np.max(yhat)) + 1.0
    ax.set_ylim(max(lo, -10), min(hi, 10))
    ax.set_xlim(*GRID)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(
        f"BPC-FL 1-D regression: {len(data.parts)} clients x {args.per_client} points, seed {args.seed}"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
