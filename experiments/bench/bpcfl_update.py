"""Benchmark: BPC-FL's client hot path, one BPC-fKL update (docs/papers/bpcfl.md#a2; Kim et al. 2022):
``B_w`` inner chains of ``L_C`` optimizer steps on the pseudocoreset from expert-trajectory checkpoints,
then the gradient of the surrogate ``J`` with respect to the pseudocoreset, ``S`` noise draws per chain,
then the SGD step on the pseudo-inputs. Measured in one process, variants interleaved.

Problem: the paper's moons client (docs/papers/bpcfl.md#s5-1, docs/papers/bpcfl.md#table-2 moons column):
``moons_mlp`` (Dense50-GN-ReLU x2, Dense2; P = 3,002) with the masked softmax cross-entropy plus ``λ/2‖θ‖²``
(λ = 0.1), the client's 20 points from ``sidejax.data.load_dataset("moons", "train", num_samples=20)``,
``K = 5`` pseudo-points (``init_pseudocoreset``, σ_z = 0.6, labels cycled by frequency), ``B_w = 20`` pairs
per update, ``L_C = 200`` Adam(1e-2) inner steps, ``S = 10`` noise draws, ``σ_ε = 1e-2``, ``ψ_x = 1e-3``,
``L_D = 150``; the pairs are drawn by :func:`sidejax.bayes.trajectory_pairs` from
:func:`sidejax.bayes.expert_trajectories` (full batch, Adam 1e-2, ``--trajectories`` 10 x ``--pretrain-steps``
300 steps, a modest J instead of the paper's 100: the pairs' cost does not depend on J).

Variants (all float32, all computing the same math with the same pairs and noise keys):

- ``sidejax``: :func:`sidejax.bayes.learn_pseudocoreset` for ``--updates`` updates, jitted, one call (the
  library's path: chains vmapped inside one update, updates in one ``lax.scan``);
- ``unrolled``: a Python loop over updates calling a jitted single update (:func:`sidejax.bayes.fkl_gradient`
  with vmapped chains, then the SGD step): isolates what the ``lax.scan`` over updates buys;
- ``per_chain``: the structure of the authors' PyTorch code (a Python loop over chains): per update, a jitted
  pair sampler, then for each of the ``B_w`` chains a jitted single-chain inner chain and a jitted
  single-chain surrogate gradient (noise keys ``draw_key(key, 2(bS + s))``, ``+ 1``, as in
  :func:`sidejax.bayes.fkl_surrogate`), the gradients averaged on the host side (eager JAX), then the SGD
  step;
- ``through_chain`` (a **different estimator**, wrong for fKL, the rKL/MTT-style path docs/papers/bpcfl.md#a2
  warns against): the jitted single update with the gradient taken *through* the inner chain (no
  ``stop_gradient``), in a Python loop over updates. Timed for context only; its pseudocoreset is not
  compared.

Cross-check: the final pseudo-inputs of ``unrolled`` and ``per_chain`` against ``sidejax``, and the first
update's gradient of ``per_chain`` against :func:`sidejax.bayes.fkl_gradient` (max abs difference relative to
the largest entry; float32 round-off, from vmapped vs single-chain reductions, is the only expected
difference).

Times are after compilation (compile time of each variant's jitted functions reported separately), best of
``--repeats`` interleaved repetitions, wall and process CPU time, reported per update; ``ratio`` = variant
wall time / sidejax wall time (> 1: slower than sidejax), ``cpu_ratio`` the same for process CPU time (less
sensitive to other jobs on a shared machine). ``temp_bytes`` is XLA's ``memory_analysis()`` temporary
buffer size of each variant's main compiled function (a proxy for peak memory; ``null`` where the backend
does not report it).

Writes JSON (default ``results/bench/bpcfl_update.json``; ``results/`` is not committed) with the machine,
the settings and every number, and prints a table.

Run: ``python -m experiments.bench.bpcfl_update [--quick] [--out FILE] [--repeats 3] [--updates 20]``
(``--quick``: B_w = 3, L_C = 5, S = 2, 3 updates, 2 trajectories x 20 steps, one repetition, no
``through_chain``, for tests; ``--skip-through`` drops that variant at any size).

Measurements and findings: docs/benchmarks.md#bpc-fkl-bpc-fls-client-step-vs-a-loop-over-chains.
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
    rel_diff,
    text_table,
    write_report,
)

METHODS = ("sidejax", "unrolled", "per_chain", "through_chain")


# ----------------------------------------------------------------------------------------------- problem


def _pretrain(args, init_fn, pretrain_loss, key, x, y, valid):
    """``(trajectories, seconds)``: the expert trajectories (full-batch Adam, a checkpoint every 5 steps)."""
    import jax
    import optax

    from sidejax.bayes import expert_trajectories
    from sidejax.keys import draw_key

    t0 = time.perf_counter()
    trajectories = jax.block_until_ready(
        jax.jit(
            lambda k1, k2: expert_trajectories(
                init_fn,
                pretrain_loss,
                k1,
                k2,
                x,
                y,
                valid,
                num_trajectories=args.trajectories,
                num_steps=args.pretrain_steps,
                save_interval=5,
                batch_size=None,
                optimizer=optax.adam(1e-2),
            )
        )(draw_key(key, 0), draw_key(key, 1))
    )
    return trajectories, time.perf_counter() - t0


def build_problem(args):
    """The moons client: data, loss, expert trajectories, pair sampler and initial pseudocoreset."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.flatten_util import ravel_pytree

    from sidejax.bayes import init_pseudocoreset, trajectory_pairs
    from sidejax.data import load_dataset
    from sidejax.fl import Batch, classification_loss
    from sidejax.keys import draw_key
    from sidejax.models import get_model

    data = load_dataset("moons", "train", num_samples=args.points, seed=args.seed)
    x = jnp.asarray(np.asarray(data.x, np.float32))
    y = jnp.asarray(np.asarray(data.y, np.int32))
    valid = jnp.ones((x.shape[0],), bool)
    spec = get_model("moons_mlp")
    module = spec.module

    def init_fn(key):
        return module.init(key, jnp.zeros((1, *spec.input_shape), jnp.float32), train=True)["params"]

    ce = classification_loss(module.apply)
    lam = args.prior_precision

    def sq_norm(params):
        flat, _ = ravel_pytree(params)
        return jnp.dot(flat, flat)

    def pretrain_loss(params, xb, yb):
        return ce(params, Batch(xb, yb, jnp.ones((xb.shape[0],), jnp.float32)), None) + 0.5 * lam * sq_norm(
            params
        )

    ones = jnp.ones((args.num_points,), jnp.float32)

    def coreset_loss(c, params):  # as sidejax.algorithms.bpcfl's client: ℓ̄(C, θ) + λ/2‖θ‖²
        return ce(params, Batch(c.inputs, c.labels, ones), None) + 0.5 * lam * sq_norm(params)

    key = jax.random.key(args.seed)
    trajectories, pretrain_s = _pretrain(args, init_fn, pretrain_loss, key, x, y, valid)
    pairs = trajectory_pairs(
        trajectories, data_offset=args.data_chain_length, save_interval=5, num_pairs=args.pairs
    )
    coreset = init_pseudocoreset(
        draw_key(key, 2), x, y, valid, args.num_points, init_std=args.init_std, num_classes=2
    )
    num_params = int(ravel_pytree(init_fn(key))[0].shape[0])
    return {
        "loss": coreset_loss,
        "pairs": pairs,
        "coreset": coreset,
        "key": draw_key(key, 3),
        "num_params": num_params,
        "pretrain_seconds": pretrain_s,
        "num_examples": int(x.shape[0]),
        "label_counts": np.bincount(np.asarray(y), minlength=2).tolist(),
    }


# ----------------------------------------------------------------------------------------------- variants


def _pieces(problem, args):
    """The jitted pieces the variants share (a namespace): the loss, pair sampler, initial pseudocoreset and
    key, the inner optimizer and :func:`fkl_gradient`'s shared keywords, the SGD step on the pseudo-inputs,
    and the per-chain loop's ``sample``, ``pick``, ``chain``, ``pair_surrogate`` and ``pair_grad``."""
    import types

    import jax
    import jax.numpy as jnp
    import optax

    from sidejax.bayes import inner_chain
    from sidejax.bayes.pseudocoresets import _perturb
    from sidejax.keys import draw_key

    loss = problem["loss"]
    pairs = problem["pairs"]
    opt = optax.adam(args.chain_lr)
    common = {
        "optimizer": opt,
        "chain_length": args.chain_length,
        "noise_std": args.noise_std,
        "num_noise": args.num_noise,
    }
    psi = args.step_size
    S = args.num_noise

    def sgd(c, g_inputs):
        return c._replace(inputs=c.inputs - psi * g_inputs)

    def pair_surrogate(c, th_d, th_c, nkey, b):  # fkl_surrogate's term for pair b (its noise keys)
        def one(s):
            index = 2 * (b * S + s)
            ed = _perturb(draw_key(nkey, index), th_d, args.noise_std) if args.noise_std > 0 else th_d
            ec = _perturb(draw_key(nkey, index + 1), th_c, args.noise_std) if args.noise_std > 0 else th_c
            return loss(c, ed) - loss(c, ec)

        return jnp.mean(jax.vmap(one)(jnp.arange(S)))

    return types.SimpleNamespace(
        loss=loss,
        pairs=pairs,
        c0=problem["coreset"],
        key=problem["key"],
        opt=opt,
        common=common,
        sgd=sgd,
        pair_surrogate=pair_surrogate,
        sample=jax.jit(lambda c, k, u: pairs(draw_key(k, 2 * u), c)),
        pick=jax.jit(lambda tree, b: jax.tree.map(lambda a: a[b], tree)),
        chain=jax.jit(lambda c, th: inner_chain(loss, c, th, opt, args.chain_length)),
        pair_grad=jax.jit(
            lambda c, th_d, th_c, nkey, b: (
                jax.grad(pair_surrogate, allow_int=True)(c, th_d, th_c, nkey, b).inputs
            )
        ),
    )


def _temp_bytes(compiled):
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _sidejax_variant(ps, args):
    """sidejax: the library's scan over updates, :func:`learn_pseudocoreset`."""
    import jax

    from sidejax.bayes import learn_pseudocoreset

    learn = jax.jit(
        lambda c, k: learn_pseudocoreset(
            ps.loss,
            c,
            k,
            sample_pairs=ps.pairs,
            num_updates=args.updates,
            step_size_inputs=args.step_size,
            **ps.common,
        )[0]
    )
    c0, key = ps.c0, ps.key
    compiled = {}

    def compile_fn():
        t0 = time.perf_counter()
        compiled["learn"] = learn.lower(c0, key).compile()
        return time.perf_counter() - t0, _temp_bytes(compiled["learn"])

    def run_fn():
        return compiled["learn"](c0, key).inputs

    return compile_fn, run_fn


def _jitted_update_variant(ps, args, update):
    """A variant whose jitted ``update(c, key, u)`` is one whole update, looped over updates on the host."""
    import jax

    c0, key, updates = ps.c0, ps.key, args.updates

    def compile_fn():
        t0 = time.perf_counter()
        comp = update.lower(c0, key, 0).compile()
        jax.block_until_ready(update(c0, key, 0))  # the jit cache the loop uses
        return time.perf_counter() - t0, _temp_bytes(comp)

    def run_fn():
        c = c0
        for u in range(updates):
            c = update(c, key, u)
        return c.inputs

    return compile_fn, run_fn


def _unrolled_variant(ps, args):
    """One update, vmapped chains (:func:`fkl_gradient`), in a host loop over updates."""
    import jax

    from sidejax.bayes import fkl_gradient
    from sidejax.keys import draw_key

    @jax.jit
    def one_update(c, k, u):
        theta_data, theta_start = ps.pairs(draw_key(k, 2 * u), c)
        out = fkl_gradient(ps.loss, c, theta_data, theta_start, draw_key(k, 2 * u + 1), **ps.common)
        return ps.sgd(c, out.grad.inputs)

    return _jitted_update_variant(ps, args, one_update)


def _per_chain_gradient(ps, c, theta_data, theta_start, nkey, pairs: int, ends=None):
    """The authors' loop structure for one update's gradient: per pair, its jitted single chain (or the
    given chain end point ``ends[b]``) and jitted pair gradient, averaged on the host (eager JAX). Returns
    ``(gradient of the pseudo-inputs, the chain end points)``."""
    import functools

    import jax.numpy as jnp

    grads, chain_ends = [], []
    for b in range(pairs):
        th_d, th_s = ps.pick((theta_data, theta_start), b)
        chain_ends.append(ps.chain(c, th_s) if ends is None else ends[b])
        grads.append(ps.pair_grad(c, th_d, chain_ends[-1], nkey, b))
    return functools.reduce(jnp.add, grads) / pairs, chain_ends


def _per_chain_variant(ps, args):
    """The authors' loop structure: one jitted chain and pair gradient per pair, averaged on the host."""
    import jax

    from sidejax.keys import draw_key

    c0, key, updates = ps.c0, ps.key, args.updates
    sample, pick, chain = ps.sample, ps.pick, ps.chain

    def per_chain_update(c, u):
        theta_data, theta_start = sample(c, key, u)
        g, _ = _per_chain_gradient(ps, c, theta_data, theta_start, draw_key(key, 2 * u + 1), args.pairs)
        return ps.sgd(c, g)

    def compile_fn():
        t0 = time.perf_counter()
        jax.block_until_ready(per_chain_update(c0, 0))  # traces and compiles sample, pick, chain, pair_grad
        th = pick(sample(c0, key, 0), 0)
        comp = chain.lower(c0, th[1]).compile()
        return time.perf_counter() - t0, _temp_bytes(comp)

    def run_fn():
        c = c0
        for u in range(updates):
            c = per_chain_update(c, u)
        return c.inputs

    return compile_fn, run_fn


def _through_variant(ps, args):
    """Through the chain (a different estimator: no stop_gradient on the inner chain)."""
    import jax
    import jax.numpy as jnp
    import optax

    from sidejax.keys import draw_key

    opt = ps.opt

    def chain_through(c, th):
        g = jax.grad(lambda t: ps.loss(c, t))

        def step(carry, _):
            t, st = carry
            upd, st = opt.update(g(t), st, t)
            return (optax.apply_updates(t, upd), st), None

        (t, _), _ = jax.lax.scan(step, (th, opt.init(th)), None, length=args.chain_length)
        return t

    @jax.jit
    def through_update(c, k, u):
        theta_data, theta_start = ps.pairs(draw_key(k, 2 * u), c)
        nkey = draw_key(k, 2 * u + 1)
        theta_data = jax.lax.stop_gradient(theta_data)

        def objective(inputs):
            cc = c._replace(inputs=inputs)
            theta_c = jax.vmap(lambda th: chain_through(cc, th))(theta_start)
            terms = jax.vmap(lambda b, d, t: ps.pair_surrogate(cc, d, t, nkey, b))(
                jnp.arange(args.pairs), theta_data, theta_c
            )
            return jnp.mean(terms)

        return ps.sgd(c, jax.grad(objective)(c.inputs))

    return _jitted_update_variant(ps, args, through_update)


def _first_update_check(ps, args, dtype_name):
    """The first update in ``dtype_name``: sidejax's :func:`fkl_gradient` (vmapped chains) against the
    per-chain loop (single chains, host-side average), and the per-chain gradient at sidejax's own chain
    end points (the surrogate-gradient math alone). Returns relative max abs differences."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.flatten_util import ravel_pytree

    from sidejax.bayes import fkl_gradient
    from sidejax.keys import draw_key

    dtype = jnp.dtype(dtype_name)
    theta_data, theta_start = ps.pairs(draw_key(ps.key, 0), ps.c0)
    cast = functools.partial(jax.tree.map, lambda a: a.astype(dtype))
    theta_data, theta_start = cast(theta_data), cast(theta_start)
    c = ps.c0._replace(inputs=ps.c0.inputs.astype(dtype))
    nkey = draw_key(ps.key, 1)
    ref = jax.jit(lambda c, d, t: fkl_gradient(ps.loss, c, d, t, nkey, **ps.common))(
        c, theta_data, theta_start
    )
    g_loop, ends = _per_chain_gradient(ps, c, theta_data, theta_start, nkey, args.pairs)
    ref_ends = [ps.pick(ref.theta_coreset, b) for b in range(args.pairs)]
    g_given, _ = _per_chain_gradient(ps, c, theta_data, theta_start, nkey, args.pairs, ends=ref_ends)
    chain_diff = [
        rel_diff(ravel_pytree(a)[0], ravel_pytree(r)[0]) for a, r in zip(ends, ref_ends, strict=True)
    ]
    g_ref = ref.grad.inputs
    assert g_ref.dtype == dtype and g_loop.dtype == dtype
    return {
        "gradient_rel_diff": rel_diff(g_loop, g_ref),
        "gradient_at_same_chain_ends_rel_diff": rel_diff(g_given, g_ref),
        "chain_ends_rel_diff_max": float(np.max(chain_diff)),
        "chain_ends_rel_diff_median": float(np.median(chain_diff)),
        "gradient_norm": float(np.linalg.norm(np.asarray(g_ref, np.float64))),
    }


def make_variants(problem, args):
    """``{name: (compile_fn, run_fn)}``: ``compile_fn()`` compiles the variant's jitted functions and returns
    ``(compile seconds, temp bytes)``; ``run_fn()`` runs ``args.updates`` updates and returns the final
    pseudo-inputs. Also returns ``first_update_check(dtype_name)`` (see :func:`_first_update_check`)."""
    ps = _pieces(problem, args)
    variants = {
        "sidejax": _sidejax_variant(ps, args),
        "unrolled": _unrolled_variant(ps, args),
        "per_chain": _per_chain_variant(ps, args),
        "through_chain": _through_variant(ps, args),
    }
    return variants, lambda dtype_name: _first_update_check(ps, args, dtype_name)


# ----------------------------------------------------------------------------------------------- timing


def _move_diff(a, ref, start) -> float:
    import numpy as np

    return float(np.max(np.abs(a - ref)) / max(float(np.max(np.abs(ref - start))), 1e-30))


def run(args) -> dict:
    import numpy as np

    problem = build_problem(args)
    variants, first_update_check = make_variants(problem, args)
    methods = [m for m in METHODS if m != "through_chain" or not args.skip_through]
    compile_s, temp = {}, {}
    for m in methods:
        compile_s[m], temp[m] = variants[m][0]()
    times, out = interleave({m: variants[m][1] for m in methods}, args.repeats)
    best_s = best(times)
    from sidejax.utils import enable_x64

    check32 = first_update_check("float32")
    with enable_x64():  # the same first update in float64: round-off no longer amplified to visible size
        check64 = first_update_check("float64")
    final = {m: np.asarray(out[m], np.float64) for m in methods}
    z0 = np.asarray(problem["coreset"].inputs, np.float64)
    u = args.updates
    wall = {m: best_s[m][0] / u for m in methods}
    cpu = {m: best_s[m][1] / u for m in methods}
    return {
        "problem": {
            "num_params": problem["num_params"],
            "num_examples": problem["num_examples"],
            "label_counts": problem["label_counts"],
            "pretrain_seconds": problem["pretrain_seconds"],
        },
        "compile_seconds": compile_s,
        "temp_bytes": temp,
        "wall_seconds_per_update": wall,
        "cpu_seconds_per_update": cpu,
        "wall_seconds_total": {m: best_s[m][0] for m in methods},
        "ratio_to_sidejax": {m: wall[m] / wall["sidejax"] for m in methods},
        "cpu_ratio_to_sidejax": {m: cpu[m] / cpu["sidejax"] for m in methods},
        "cross_check": {
            "first_update_float32": check32,
            "first_update_float64": check64,
            # final pseudo-inputs: max |Z_variant - Z_sidejax| / max |Z_sidejax - Z_0| (relative to the move)
            "final_inputs_diff_over_move": {
                m: _move_diff(final[m], final["sidejax"], z0) for m in methods if m != "sidejax"
            },
            "final_inputs_rel_diff": {m: rel_diff(final[m], final["sidejax"]) for m in methods},
            "inputs_move_max_abs": float(np.max(np.abs(final["sidejax"] - z0))),
            "finite": bool(all(np.all(np.isfinite(v)) for v in final.values())),
        },
    }


# ----------------------------------------------------------------------------------------------- CLI


#: the command line: flag -> (type, default, help); Sized(full, quick) defaults differ with --quick
FLAGS = {
    "--quick": (bool, False, "tiny sizes for tests"),
    "--updates": (int, Sized(20, 3), "BPC-fKL updates timed"),
    "--pairs": (int, Sized(20, 3), "B_w"),
    "--chain-length": (int, Sized(200, 5), "L_C"),
    "--num-noise": (int, Sized(10, 2), "S"),
    "--trajectories": (int, Sized(10, 2), "expert trajectories J"),
    "--pretrain-steps": (int, Sized(300, 20), "steps per trajectory"),
    "--data-chain-length": (int, Sized(150, 10), "L_D"),
    "--repeats": (int, Sized(3, 1), "timed repetitions, best kept"),
    "--num-points": (int, 5, "K"),
    "--points": (int, 20, "the client's data points"),
    "--noise-std": (float, 1e-2, None),
    "--chain-lr": (float, 1e-2, None),
    "--step-size": (float, 1e-3, "psi_x"),
    "--prior-precision": (float, 0.1, None),
    "--init-std": (float, 0.6, None),
    "--skip-through": (bool, Sized(False, True), "skip the through-the-chain variant"),
    "--seed": (int, 0, None),
}


def _parse_args(argv):
    p = parser("experiments.bench.bpcfl_update", __doc__, FLAGS, out="results/bench/bpcfl_update.json")
    args = p.parse_args(argv)
    for name in ("updates", "pairs", "num_noise", "trajectories", "pretrain_steps", "repeats", "num_points"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.chain_length < 0 or args.data_chain_length < 0 or args.data_chain_length % 5:
        p.error("--chain-length >= 0 and --data-chain-length a multiple of 5 (>= 0) required")
    if args.pretrain_steps % 5 or args.data_chain_length >= args.pretrain_steps:
        p.error("--pretrain-steps must be a multiple of 5 and > --data-chain-length")
    if args.num_points > args.points:
        p.error("--num-points (K) must not exceed --points")
    return args


def main(argv=None) -> dict:
    args = _parse_args(argv)
    load_before = load_average()
    import optax

    res = run(args)
    result = {
        "machine": machine_record(load_before=load_before, optax_version=optax.__version__),
        "settings": {
            "model": "moons_mlp",
            "dataset": "moons train",
            **{k: v for k, v in vars(args).items() if k != "out"},
            "inner_optimizer": f"adam({args.chain_lr})",
            "pretrain_optimizer": "adam(0.01), full batch",
            "dtype": "float32",
        },
        **res,
    }
    write_report(result, args.out, table=format_table(result))
    return result


def format_table(result: dict) -> str:
    """The readable table: per variant, compile s, ms per update (wall and CPU), ratio, temp MB, final-Z
    difference from sidejax relative to sidejax's move; then the first-update cross-check."""
    s = result["settings"]
    cc = result["cross_check"]
    lines = [
        f"BPC-fKL update, moons_mlp (P = {result['problem']['num_params']}), K = {s['num_points']}, "
        f"B_w = {s['pairs']}, L_C = {s['chain_length']}, S = {s['num_noise']}, {s['updates']} updates; "
        f"ms per update, best of {s['repeats']}; ratio = variant / sidejax (wall; cpu_ratio: process CPU)"
    ]
    columns = [("variant", "<14"), ("compile_s", "9.2f"), ("wall_ms", "9.2f"), ("cpu_ms", "9.2f")]
    columns += [("ratio", "7.3f"), ("cpu_ratio", "9.3f"), ("temp_MB", ">8"), ("dZ/move", "8.1e")]
    diffs = {"sidejax": 0.0, **cc["final_inputs_diff_over_move"]}
    rows = []
    for m, wall in result["wall_seconds_per_update"].items():
        tb = result["temp_bytes"][m]
        rows.append(
            [m, result["compile_seconds"][m], 1e3 * wall, 1e3 * result["cpu_seconds_per_update"][m]]
            + [result["ratio_to_sidejax"][m], result["cpu_ratio_to_sidejax"][m]]
            + ["n/a" if tb is None else f"{tb / 2**20:.2f}", diffs[m]]
        )
    lines += text_table(columns, rows)
    for name in ("float32", "float64"):
        c = cc[f"first_update_{name}"]
        lines.append(
            f"first update, per_chain vs sidejax, {name}: gradient {c['gradient_rel_diff']:.1e}, at the same "
            f"chain ends {c['gradient_at_same_chain_ends_rel_diff']:.1e}, chain ends max "
            f"{c['chain_ends_rel_diff_max']:.1e} (median {c['chain_ends_rel_diff_median']:.1e})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
