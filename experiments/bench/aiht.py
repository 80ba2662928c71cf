"""Benchmark: CoreSet-PFedBayes' coreset hot path, :func:`sidejax.bayes.aiht` (A-IHT I, Zhang et al.,
AISTATS 2021; docs/papers/coreset_pfedbayes.md#s2-4), against a plain numpy float64 A-IHT (what the authors'
released code runs) on the paper's client problem, measured in the same process.

Problems (real, not synthetic low-rank): ``--clients`` (default 10) clients, each a uniformly random subset of
``--n`` (default 1000) of the 1,437 bundled ``digits`` training images (8x8, flattened, plus a bias), a
softmax regression ``65 x 10`` per client fitted to its MAP (prior ``N(0, 1)``, L-BFGS in float64) and a
diagonal Laplace posterior around it (precision ``1 + Σ_i x_id² p_ic (1 − p_ic)``: a mean-field Gaussian,
like the library's variational ``q̂``). ``J_max`` posterior samples are drawn once per client and
``L[s, j] = log p(y_j | x_j, θ_s)``; for each ``k`` in ``--ks`` (default 500, 300, 150, 100: the paper's
50/30/15/10% coresets) the first ``J = max(100, 2k)`` samples give ``(y, Φ) =``
:func:`sidejax.bayes.projected_potentials` ``(L)`` (float32, the library's input) and the same formula in
float64 (numpy's input). Each ``Φ`` is ``[J, n]``.

Compared, per ``k`` (defaults ``max_iter = 300``, ``tol = 1e-5``, exact line-search step, no sum constraint):

- ``sidejax vmap``: ``jax.jit(jax.vmap(aiht))`` over the 10 clients, one call (float32; the way
  :mod:`sidejax.algorithms.pfedbayes` runs it inside a round);
- ``sidejax loop``: ``jax.jit(aiht)`` called once per client from Python (the same compiled solve);
- ``numpy``: :func:`numpy_aiht`, the same algorithm in float64 numpy written here (active set
  ``S = supp(z) ∪ top-k |∇|`` outside it, ``μ = ‖∇_S‖²/(2‖Φ∇_S‖²)``, full-gradient step, ``k`` largest signed
  entries clipped at 0, momentum ``τ = ⟨y − Φw, Φd⟩/‖Φd‖²``, stop when ``‖d‖ < tol·‖w‖`` from the second
  iteration, at a stationary ``z`` or after ``max_iter``), looped over clients.

Times are after compilation (compile time of each jitted function reported separately), best of
``--repeats`` interleaved repetitions, wall and process CPU time. ``ratio`` = sidejax time / numpy time
(< 1: sidejax faster), per client (loop) and for the 10-client batch (vmap). Quality, per client: the
relative objective ``f(w)/‖y‖²`` (``f(w) = ‖y − Φw‖²``, evaluated in float64 on the float64 ``Φ`` for every
method), iterations, support size; the sidejax/numpy objective difference is a correctness cross-check
(float32 against float64, so agreement is up to float32 round-off and, where the two runs pick different
supports, a different local optimum of the non-convex problem). Not timed, for context:
``scipy.optimize.nnls`` (non-negative least squares without sparsity: its support size, its objective,
and the objective after keeping its ``k`` largest entries) and ``--random-draws`` uniform ``k``-subsets with
weights ``n/k`` (CoreSet-PFedBayes' initial coreset; mean objective).

Writes JSON (default ``results/bench/aiht.json``; ``results/`` is not committed) with the machine, the
settings, the problem construction and every number, and prints a table.

Run: ``python -m experiments.bench.aiht [--quick] [--out FILE] [--repeats 3] [--ks 500 300 150 100]``
(``--quick``: n = 60, k = 12, 3 clients, one repetition, for tests).

Measurements and findings: docs/benchmarks.md#a-iht-coreset-pfedbayes-coreset-step-vs-a-numpy-implementation.
"""

from __future__ import annotations

import time

from experiments.bench.common import (
    Sized,
    best,
    interleave,
    load_average,
    machine_record,
    parser,
    text_table,
    write_report,
)

DEFAULT_KS = (500, 300, 150, 100)
METHODS = ("sidejax_vmap", "sidejax_loop", "numpy")


def num_samples(k: int) -> int:
    """``J = max(100, 2k)`` (CoreSet-PFedBayes' default, docs/papers/coreset_pfedbayes.md#e6)."""
    return max(100, 2 * k)


# ----------------------------------------------------------------------------------------------- problems


def _log_softmax(z):
    import numpy as np

    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def client_log_likelihoods(x, labels, num_draws: int, rng, classes: int = 10):
    """``L [num_draws, n]``: per-point log-likelihoods of a softmax regression at draws of its diagonal
    Laplace posterior (prior ``N(0, 1)``), float64."""
    import numpy as np
    from scipy.optimize import minimize

    n, d = x.shape
    onehot = np.eye(classes)[labels]

    def neg_log_post(flat):
        theta = flat.reshape(d, classes)
        logp = _log_softmax(x @ theta)
        p = np.exp(logp)
        value = -np.sum(onehot * logp) + 0.5 * np.sum(theta * theta)
        grad = x.T @ (p - onehot) + theta
        return value, grad.ravel()

    fit = minimize(neg_log_post, np.zeros(d * classes), jac=True, method="L-BFGS-B", options={"maxiter": 500})
    theta = fit.x.reshape(d, classes)
    p = np.exp(_log_softmax(x @ theta))
    precision = 1.0 + (x * x).T @ (p * (1.0 - p))  # [d, classes]
    std = 1.0 / np.sqrt(precision)
    out = np.empty((num_draws, n))
    for start in range(0, num_draws, 100):
        stop = min(start + 100, num_draws)
        draws = theta + std * rng.standard_normal((stop - start, d, classes))
        logp = _log_softmax(np.einsum("nd,sdc->snc", x, draws))
        out[start:stop] = np.take_along_axis(logp, labels[None, :, None], axis=2)[..., 0]
    return out


def make_log_likelihoods(n: int, clients: int, num_draws: int, seed: int = 0):
    """``L [clients, num_draws, n]`` (float64) on ``digits``: each client a uniform random ``n``-subset."""
    import numpy as np

    from sidejax.data import load_dataset

    data = load_dataset("digits", "train")
    images = np.asarray(data.x, np.float64).reshape(len(data.y), -1)
    feats = np.concatenate([images, np.ones((len(images), 1))], axis=1)
    labels_all = np.asarray(data.y, np.int64)
    if n > len(labels_all):
        raise ValueError(f"n = {n} exceeds the {len(labels_all)} digits training images")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(clients):
        idx = rng.choice(len(labels_all), n, replace=False)
        out.append(client_log_likelihoods(feats[idx], labels_all[idx], num_draws, rng))
    return np.stack(out)


def projections64(ll):
    """float64 numpy mirror of :func:`sidejax.bayes.projected_potentials` (``ll [..., J, n]``)."""
    import numpy as np

    phi = (ll - ll.mean(axis=-2, keepdims=True)) / np.sqrt(ll.shape[-2])
    return phi.sum(axis=-1), phi


# ----------------------------------------------------------------------------------------------- numpy A-IHT


def numpy_aiht(y, phi, k: int, *, max_iter: int = 300, tol: float = 1e-5):
    """A-IHT I in numpy (float64): the algorithm of :func:`sidejax.bayes.aiht` with its defaults
    (``step_scale = 1``, no de-bias, no sum constraint), written as a numpy user would.

    Returns ``(weights [n], objective, iterations, converged)``."""
    import numpy as np

    phi = np.asarray(phi, np.float64)
    y = np.asarray(y, np.float64)
    n = phi.shape[1]
    w = np.zeros(n)
    z = np.zeros(n)
    t = 0
    converged = False
    while t < max_iter and not converged:
        g = -2.0 * (phi.T @ (y - phi @ z))
        in_z = z != 0
        outside = np.flatnonzero(~in_z)
        support = in_z.copy()
        if outside.size <= k:
            support[outside] = True
        else:
            top = np.argpartition(-np.abs(g[outside]), k - 1)[:k]
            support[outside[top]] = True
        g_s = np.where(support, g, 0.0)
        pg = phi @ g_s
        den = 2.0 * (pg @ pg)
        moving = den > 0
        if moving:
            b = z - (g_s @ g_s) / den * g
            keep = np.argpartition(-b, k - 1)[:k]
            w_new = np.zeros(n)
            w_new[keep] = np.maximum(b[keep], 0.0)
        else:  # z is stationary: keep w and stop
            w_new = w
        d = w_new - w
        pd = phi @ d
        den_d = pd @ pd
        tau = (y - phi @ w_new) @ pd / den_d if den_d > 0 else 0.0
        z = w_new + tau * d
        converged = (t >= 1 and np.linalg.norm(d) < tol * np.linalg.norm(w_new)) or not moving
        w = w_new
        t += 1
    r = y - phi @ w
    return w, float(r @ r), t, bool(converged)


# ----------------------------------------------------------------------------------------------- timing


def _objective64(y, phi, w) -> float:
    import numpy as np

    r = y - phi @ np.asarray(w, np.float64)
    return float(r @ r)


def _stats(values) -> dict:
    import numpy as np

    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}


def _inputs(k, ll64) -> dict:
    """The first ``J = num_samples(k)`` draws' projections in float64 (numpy's) and float32 (sidejax's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sidejax.bayes import projected_potentials

    j = num_samples(k)
    ll = ll64[:, :j, :]
    y64, phi64 = projections64(ll)
    y32, phi32 = jax.vmap(projected_potentials)(jnp.asarray(ll, jnp.float32))
    proj_err = float(np.max(np.abs(np.asarray(phi32, np.float64) - phi64)) / np.max(np.abs(phi64)))
    ynorm2 = np.einsum("cj,cj->c", y64, y64)
    return {
        "J": j,
        "y64": y64,
        "phi64": phi64,
        "y32": y32,
        "phi32": phi32,
        "proj_err": proj_err,
        "ynorm2": ynorm2,
    }


def _time_solvers(solve, p, k, *, repeats, max_iter, tol):
    """Compiles the looped and vmapped solves, then times the three methods interleaved ``repeats`` times.
    Returns ``(compile seconds, best [wall, cpu] per method, each method's last result)``."""
    import jax

    y32, phi32, y64, phi64 = p["y32"], p["phi32"], p["y64"], p["phi64"]
    clients = y64.shape[0]
    single = jax.jit(solve)
    batch = jax.jit(jax.vmap(solve))
    t0 = time.perf_counter()
    single_c = single.lower(y32[0], phi32[0]).compile()
    t1 = time.perf_counter()
    batch_c = batch.lower(y32, phi32).compile()
    t2 = time.perf_counter()
    compile_s = {"sidejax_loop": t1 - t0, "sidejax_vmap": t2 - t1}
    rows = [(y32[c], phi32[c]) for c in range(clients)]

    calls = {
        "sidejax_vmap": lambda: batch_c(y32, phi32),
        "sidejax_loop": lambda: [single_c(*r) for r in rows],
        "numpy": lambda: [
            numpy_aiht(y64[c], phi64[c], k, max_iter=max_iter, tol=tol) for c in range(clients)
        ],
    }
    times, out = interleave(calls, repeats)
    return compile_s, best(times), out


def _float64_solve(solve, y64, phi64):
    """Cross-check of the algorithm: sidejax in float64 (untimed). Returns ``(weights, iterations)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sidejax.utils import enable_x64

    with enable_x64():
        r64 = jax.jit(jax.vmap(solve))(jnp.asarray(y64, jnp.float64), jnp.asarray(phi64, jnp.float64))
        return np.asarray(r64.weights, np.float64), np.asarray(r64.iterations).tolist()


def _nnls_context(k, y64, phi64, ynorm2) -> dict:
    """Untimed context: ``scipy.optimize.nnls`` per client, its objective and its top-``k`` entries'."""
    import numpy as np
    from scipy.optimize import nnls

    clients, _, n = phi64.shape
    nnls_rel, nnls_topk_rel, nnls_support, nnls_s = [], [], [], 0.0
    for c in range(clients):
        t0 = time.perf_counter()
        x, _ = nnls(phi64[c], y64[c], maxiter=50 * n)
        nnls_s += time.perf_counter() - t0
        nnls_rel.append(_objective64(y64[c], phi64[c], x) / ynorm2[c])
        nnls_support.append(int(np.sum(x > 0)))
        xk = np.zeros(n)
        top = np.argsort(-x)[:k]
        xk[top] = x[top]
        nnls_topk_rel.append(_objective64(y64[c], phi64[c], xk) / ynorm2[c])
    return {
        "relative_objective": nnls_rel,
        "support_size": nnls_support,
        "top_k_relative_objective": nnls_topk_rel,
        "total_seconds": nnls_s,
    }


def _random_context(k, y64, phi64, ynorm2, *, random_draws, seed) -> list:
    """Untimed context: per client, the mean relative objective of uniform ``k``-subsets weighted ``n/k``."""
    import numpy as np

    clients, _, n = phi64.shape
    rng = np.random.default_rng(seed + k)
    rand_rel = []
    for c in range(clients):
        vals = []
        for _ in range(random_draws):
            wr = np.zeros(n)
            wr[rng.choice(n, k, replace=False)] = n / k
            vals.append(_objective64(y64[c], phi64[c], wr) / ynorm2[c])
        rand_rel.append(float(np.mean(vals)))
    return rand_rel


def _rel_diff(f, ref):
    import numpy as np

    return np.abs(f - ref) / np.maximum(ref, 1e-300)


def _weights_diff(w, ref):
    import numpy as np

    return (np.max(np.abs(w - ref), axis=1) / np.maximum(np.max(ref, axis=1), 1e-300)).tolist()


def _quality(out, p, w64, it64) -> dict:
    """The ``sidejax``, ``numpy``, ``cross_check`` and ``sidejax_float64`` entries of a ``k``'s result."""
    import numpy as np

    y64, phi64, ynorm2 = p["y64"], p["phi64"], p["ynorm2"]
    clients = y64.shape[0]
    vm = out["sidejax_vmap"]
    w_vm = np.asarray(vm.weights, np.float64)
    w_loop = np.stack([np.asarray(r.weights, np.float64) for r in out["sidejax_loop"]])
    w_np = np.stack([r[0] for r in out["numpy"]])
    f_vm = np.array([_objective64(y64[c], phi64[c], w_vm[c]) for c in range(clients)])
    f_np = np.array([r[1] for r in out["numpy"]])
    rel_vm, rel_np = f_vm / ynorm2, f_np / ynorm2
    f64 = np.array([_objective64(y64[c], phi64[c], w64[c]) for c in range(clients)])
    same_support = [bool(np.array_equal(w_vm[c] > 0, w_np[c] > 0)) for c in range(clients)]
    return {
        "sidejax": {
            "relative_objective": rel_vm.tolist(),
            "relative_objective_float32": (np.asarray(vm.objective, np.float64) / ynorm2).tolist(),
            "iterations": np.asarray(vm.iterations).tolist(),
            "converged": np.asarray(vm.converged).tolist(),
            "support_size": np.sum(w_vm > 0, axis=1).tolist(),
            "min_weight": float(w_vm.min()),
            "weight_sum": np.sum(w_vm, axis=1).tolist(),
            "vmap_vs_loop_max_abs_weight_diff": float(np.max(np.abs(w_vm - w_loop))),
        },
        "numpy": {
            "relative_objective": rel_np.tolist(),
            "iterations": [r[2] for r in out["numpy"]],
            "converged": [r[3] for r in out["numpy"]],
            "support_size": np.sum(w_np > 0, axis=1).tolist(),
            "min_weight": float(w_np.min()),
        },
        "cross_check": {
            "objective_rel_diff": _rel_diff(f_vm, f_np).tolist(),
            "objective_diff_over_ynorm2": (np.abs(rel_vm - rel_np)).tolist(),
            "same_support": same_support,
            "weights_max_abs_diff_over_max_weight": _weights_diff(w_vm, w_np),
        },
        "sidejax_float64": {
            "relative_objective": (f64 / ynorm2).tolist(),
            "iterations": it64,
            "objective_rel_diff_vs_numpy": _rel_diff(f64, f_np).tolist(),
            "weights_max_abs_diff_over_max_weight_vs_numpy": _weights_diff(w64, w_np),
            "same_support_as_numpy": [bool(np.array_equal(w64[c] > 0, w_np[c] > 0)) for c in range(clients)],
        },
    }


def _summary(q, nnls_ctx, rand_rel) -> dict:
    """Means/extremes over clients of the objectives, iterations and context numbers."""
    import numpy as np

    sj, nps = q["sidejax"], q["numpy"]
    return {
        "sidejax_rel_objective": _stats(sj["relative_objective"]),
        "numpy_rel_objective": _stats(nps["relative_objective"]),
        "sidejax_iterations": _stats(sj["iterations"]),
        "numpy_iterations": _stats(nps["iterations"]),
        "objective_rel_diff": _stats(q["cross_check"]["objective_rel_diff"]),
        "float64_objective_rel_diff": _stats(q["sidejax_float64"]["objective_rel_diff_vs_numpy"]),
        "sidejax_converged_fraction": float(np.mean(np.asarray(sj["converged"]))),
        "nnls_rel_objective": _stats(nnls_ctx["relative_objective"]),
        "nnls_support_size": _stats(nnls_ctx["support_size"]),
        "nnls_top_k_rel_objective": _stats(nnls_ctx["top_k_relative_objective"]),
        "random_rel_objective": _stats(rand_rel),
    }


def run_k(k, ll64, *, repeats, max_iter, tol, random_draws, seed) -> dict:
    """Every measurement of one ``k`` over the clients' log-likelihoods ``ll64 [C, J_max, n]``."""
    import functools

    from sidejax.bayes import aiht

    clients, _, n = ll64.shape
    p = _inputs(k, ll64)
    solve = functools.partial(aiht, k=k, max_iter=max_iter, tol=tol)
    compile_s, best, out = _time_solvers(solve, p, k, repeats=repeats, max_iter=max_iter, tol=tol)
    w64, it64 = _float64_solve(solve, p["y64"], p["phi64"])
    q = _quality(out, p, w64, it64)
    nnls_ctx = _nnls_context(k, p["y64"], p["phi64"], p["ynorm2"])
    rand_rel = _random_context(k, p["y64"], p["phi64"], p["ynorm2"], random_draws=random_draws, seed=seed)
    wall = {m: best[m][0] for m in METHODS}
    cpu = {m: best[m][1] for m in METHODS}
    return {
        "k": k,
        "J": p["J"],
        "n": n,
        "clients": clients,
        "projection_float32_max_rel_error": p["proj_err"],
        "compile_seconds": compile_s,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "wall_seconds_per_client": {m: wall[m] / clients for m in METHODS},
        "ratio_sidejax_over_numpy": {
            "batch_vmap": wall["sidejax_vmap"] / wall["numpy"],
            "per_client_loop": wall["sidejax_loop"] / wall["numpy"],
        },
        **q,
        "nnls": nnls_ctx,
        "random_subset": {"draws": random_draws, "mean_relative_objective": rand_rel},
        "summary": _summary(q, nnls_ctx, rand_rel),
    }


# ----------------------------------------------------------------------------------------------- CLI


#: the command line: flag -> (type, default, help); Sized(full, quick) defaults differ with --quick
FLAGS = {
    "--quick": (bool, False, "tiny sizes (n 60, k 12, 3 clients, 1 repeat)"),
    "--n": (int, Sized(1000, 60), "points per client"),
    "--ks": ([int], Sized(list(DEFAULT_KS), [12]), "coreset sizes"),
    "--clients": (int, Sized(10, 3), "clients"),
    "--repeats": (int, Sized(3, 1), "timed repetitions, best kept"),
    "--max-iter": (int, 300, None),
    "--tol": (float, 1e-5, None),
    "--random-draws": (int, 5, "uniform k-subsets per client"),
    "--seed": (int, 0, None),
}


def _parse_args(argv):
    p = parser("experiments.bench.aiht", __doc__, FLAGS, out="results/bench/aiht.json")
    args = p.parse_args(argv)
    if args.n < 2 or args.clients < 1 or args.repeats < 1 or args.random_draws < 1 or args.max_iter < 1:
        p.error("--n >= 2, --clients, --repeats, --random-draws and --max-iter >= 1 required")
    if any(not 1 <= k <= args.n for k in args.ks):
        p.error(f"every k must be in [1, n = {args.n}], got {args.ks}")
    return args


def main(argv=None) -> dict:
    args = _parse_args(argv)
    load_before = load_average()
    import scipy

    t0 = time.perf_counter()
    j_max = max(num_samples(k) for k in args.ks)
    ll64 = make_log_likelihoods(args.n, args.clients, j_max, args.seed)
    build_s = time.perf_counter() - t0
    results = {}
    for k in args.ks:
        results[str(k)] = run_k(
            k,
            ll64,
            repeats=args.repeats,
            max_iter=args.max_iter,
            tol=args.tol,
            random_draws=args.random_draws,
            seed=args.seed,
        )
    result = {
        "machine": machine_record(load_before=load_before, scipy_version=scipy.__version__),
        "problem": {
            "phi": "digits softmax regression (65x10), per-point log-likelihoods at diagonal-Laplace "
            "posterior draws, projected_potentials (not synthetic)",
            "dataset": "digits train (1437 images), each client a uniform random n-subset",
            "J": "max(100, 2k), the first J of J_max draws per client",
            "J_max": j_max,
            "build_seconds": build_s,
        },
        "settings": {
            "n": args.n,
            "ks": list(args.ks),
            "clients": args.clients,
            "repeats": args.repeats,
            "max_iter": args.max_iter,
            "tol": args.tol,
            "random_draws": args.random_draws,
            "seed": args.seed,
            "quick": args.quick,
            "sidejax_dtype": "float32",
            "numpy_dtype": "float64",
        },
        "results": results,
    }
    write_report(result, args.out, table=format_table(result))
    return result


def _mean(key: str, stat: str = "mean"):
    """The ``stat`` over clients of a k's summary ``key``."""
    return lambda r: r["summary"][key][stat]


#: the printed table's columns: (header, format, value of one k's result)
_COLUMNS = (
    ("k", "5d", lambda r: r["k"]),
    ("J", "5d", lambda r: r["J"]),
    ("vmap_all", "8.2f", lambda r: 1e3 * r["wall_seconds"]["sidejax_vmap"]),
    ("loop/cl", "8.2f", lambda r: 1e3 * r["wall_seconds_per_client"]["sidejax_loop"]),
    ("np/cl", "8.2f", lambda r: 1e3 * r["wall_seconds_per_client"]["numpy"]),
    ("r_vmap", "7.3f", lambda r: r["ratio_sidejax_over_numpy"]["batch_vmap"]),
    ("r_loop", "7.3f", lambda r: r["ratio_sidejax_over_numpy"]["per_client_loop"]),
    ("comp_s", "6.2f", lambda r: r["compile_seconds"]["sidejax_vmap"]),
    ("f_sidejax", "10.3e", _mean("sidejax_rel_objective")),
    ("f_numpy", "10.3e", _mean("numpy_rel_objective")),
    ("rel_diff", "9.2e", _mean("objective_rel_diff", "max")),
    ("diff_f64", "9.2e", _mean("float64_objective_rel_diff", "max")),
    ("it_sj", "6.1f", _mean("sidejax_iterations")),
    ("it_np", "6.1f", _mean("numpy_iterations")),
    ("f_nnls", "9.2e", _mean("nnls_rel_objective")),
    ("nnls|S|", "7.1f", _mean("nnls_support_size")),
    ("f_nnls_k", "9.2e", _mean("nnls_top_k_rel_objective")),
    ("f_random", "9.2e", _mean("random_rel_objective")),
)


def format_table(result: dict) -> str:
    """The readable table: per k, wall ms (best of repeats) and objectives (means over clients)."""
    s = result["settings"]
    lines = [
        f"A-IHT, n = {s['n']}, {s['clients']} clients, J = max(100, 2k); wall ms, best of {s['repeats']}; "
        "f/|y|^2 and iterations: mean over clients; ratio = sidejax / numpy"
    ]
    rows = [[value(r) for *_, value in _COLUMNS] for r in result["results"].values()]
    lines += text_table([(title, spec) for title, spec, _ in _COLUMNS], rows)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
