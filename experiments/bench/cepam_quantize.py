"""Benchmark: throughput of CEPAM's LRSUQ (quantization whose error *is* the Gaussian / Laplace DP noise)
per lattice, against plain noise addition (the same output law, without compression).

For a vector ``x`` of ``--dim`` coordinates (default 25,818, the CEPAM MLP; several sizes may be given),
``x ~ N(0, I/d)`` normalised to norm 1, and the paper's noise levels ``σ = b = 0.1``, each case (a lattice
and a noise family) times, jitted, after a warm-up call, in one process, interleaved over cases and best
of ``--repeats``:

- ``quantize``: :func:`sidejax.coding.lattice.lrsuq_quantize` ``(shared_key, x, lattice, noise) ->
  (h, coords)`` (trials ``1 … T0`` for every block, then the stragglers gathered and finished by the
  per-block ``lax.while_loop``);
- ``reconstruct``: :func:`sidejax.coding.lattice.lrsuq_reconstruct` (the decoder's regeneration of the
  latents and the accepted dithers);
- ``encode`` / ``decode``: the full coder with real bitstreams,
  ``c = clip_update(lrsuq_coder(lattice, noise), gamma=1.0)``, ``c.encode(keys, PointMass(x),
  PointMass(0), c.init(d))`` and ``c.decode(keys.shared, PointMass(0), c.init(d), message)``;
  ``round_trip`` is their sum (bits per coordinate ``num_bits / d`` and the mean trial index reported);
- ``baseline``: ``x + σ·N(0, 1)`` (``jax.random.normal``) or ``x + b·Lap(0, 1)`` (``jax.random.laplace``),
  what a user who does not compress runs to get the same output law.

Lattices ``Z^1, Z^2, Z^3, A2, D4, E8`` with ``GaussianNoise(σ)``; ``LaplaceNoise(b)`` on ``Z^1`` only
(LRSUQ's Laplace layering needs a one-dimensional lattice). Reported: coordinates per second of each step,
and ``slowdown`` = LRSUQ time / baseline time (how many times slower than plain noise addition). Both wall
and process CPU time (all threads) are recorded. The run fails loudly (``RuntimeError``) unless every
decoded stream is valid and the decoded error has mean ≈ 0 and std ≈ ``σ`` (Gaussian) or ``√2·b``
(Laplace), within 5 standard errors of the sample std.

Writes JSON (default ``results/bench/cepam_quantize.json``) with the machine (``jax.devices()``, CPU
count), the sizes and every case's wall and CPU seconds, and prints a table.

Run: ``python -m experiments.bench.cepam_quantize [--dim 25818 ...] [--repeats 5]``.

Measured (2-core CPU, shared: other jobs may have been running; d = 25,818, best of 5 interleaved, wall
time; Mcoord/s = million coordinates per second; slowdown vs. plain noise addition):

::

    case           h mean h max bits/c err std        quantize     reconstruct      round trip noise add
    ----------------------------------------------------------------------------------------------------
    Z^1-gaussian     1.00     1   0.19  0.0998   10.87 (   7x)   11.60 (   6x)    1.86 (  38x)      71.3
    Z^1-laplace      1.00     1   0.21  0.1405   11.88 (   7x)   13.54 (   6x)    2.01 (  40x)      81.1
    Z^2-gaussian     1.27     8   0.68  0.1000    2.63 (  24x)    4.38 (  14x)    0.96 (  65x)      62.5
    Z^3-gaussian     1.90    12   0.65  0.1001    4.13 (  16x)   18.60 (   4x)    1.52 (  45x)      67.9
    A2-gaussian      1.10     5   0.65  0.0999    3.23 (  21x)    4.10 (  16x)    1.03 (  65x)      67.0
    D4-gaussian      1.62     9   0.43  0.0998    2.75 (  27x)    5.93 (  13x)    0.98 (  77x)      75.3
    E8-gaussian      3.93    29   0.41  0.1007    1.04 (  61x)   10.45 (   6x)    0.72 (  88x)      63.4

    Seconds (wall; CPU time equal within 1% except E8 quantize, 4% below: XLA runs these single-threaded),
    now and [before the three changes below, same machine and run protocol]:

    case            quantize          reconstr.         encode            decode            noise add
    Z^1-gaussian     2.37 [18.25]ms    2.23 [18.65]ms    5.84 [22.33]ms    8.07 [25.34]ms   0.36ms
    Z^1-laplace      2.17 [12.21]ms    1.91 [11.75]ms    5.38 [15.40]ms    7.50 [19.03]ms   0.32ms
    Z^2-gaussian     9.82 [27.51]ms    5.90 [16.84]ms   13.56 [32.21]ms   13.21 [60.38]ms   0.41ms
    Z^3-gaussian     6.25 [13.12]ms    1.39 [ 3.18]ms    8.57 [16.92]ms    8.44 [38.31]ms   0.38ms
    A2-gaussian      7.99 [25.92]ms    6.29 [16.59]ms   11.57 [29.81]ms   13.45 [61.03]ms   0.39ms
    D4-gaussian      9.39 [21.19]ms    4.35 [ 6.59]ms   14.75 [25.16]ms   11.69 [36.44]ms   0.34ms
    E8-gaussian     24.75 [52.06]ms    2.47 [ 2.14]ms   26.09 [58.42]ms    9.80 [12.16]ms   0.41ms

The costs of the earlier profile and what was done about them (each change measured alone, d = 25,818):

- the per-block latent was ``jax.random.gamma``, a rejection loop that under ``vmap`` makes every block pay
  for the slowest (16 of 18 ms of ``Z^1``). :func:`sidejax.coding.lrsuq.lrsuq_latent` now draws
  ``U ~ χ²_{n+2}`` as the sum of ``n + 2`` squared normals and ``Gamma(2, 1)`` as ``−log u₁ − log u₂``
  (the same laws): ``Z^1`` quantize 18.3 -> 2.5 ms, reconstruct 18.7 -> 4.0 ms (Laplace 12 -> 2 ms),
  ``Z^2`` and ``A2`` reconstruct 17 -> 10 and 6 ms; ``E8`` (shape 5, where the gamma sampler rarely
  rejects) loses about 0.4 ms on its 10 normals per block;
- the vmapped ``while_loop`` ran every block for ``max h`` trials (32 for ``E8`` against a mean of 3.9).
  :func:`sidejax.coding.lattice.lrsuq_quantize` now runs ``T0`` trials for all blocks, then gathers the
  unaccepted ones into a static buffer and finishes them with the uncapped loop (further rounds if more
  are left), bit-identical ``(h, coords)``: quantize ``E8`` 55 -> 25 ms, ``D4`` 22 -> 11 ms, ``Z^3``
  14 -> 5 ms, ``Z^2`` 21 -> 11 ms, ``A2`` 18 -> 8.5 ms;
- the decoder parses every bit position of the static buffer, which a slack of 64 bits per block for the
  trial indices made about 3x larger than needed. The trial part is now the ``10^{−18}`` quantile of the
  negative-binomial sum of the Golomb quotients (:func:`sidejax.coding.lattice.trial_index_capacity_bits`):
  decode ``Z^2`` 48 -> 13 ms, ``A2`` 50 -> 13 ms, ``Z^3`` 35 -> 8 ms, ``D4`` 33 -> 12 ms, ``E8`` 12 -> 10 ms.
"""

from __future__ import annotations

import argparse
import math
import time

from experiments.bench.common import machine_record, write_report

DEFAULT_DIM = 25_818  # the CEPAM MLP
LATTICES = ("z1", "z2", "z3", "a2", "d4", "e8")
STEPS = ("quantize", "reconstruct", "encode", "decode", "round_trip", "baseline")
# excess kurtosis + 2 = E[z^4]/σ^4 − 1: the sample variance has variance (that)·σ^4/d
_KURTOSIS_MINUS_ONE = {"gaussian": 2.0, "laplace": 5.0}


def _lattice(name: str):
    from sidejax import lattices

    return {
        "z1": lambda: lattices.integer_lattice(1),
        "z2": lambda: lattices.integer_lattice(2),
        "z3": lambda: lattices.integer_lattice(3),
        "a2": lattices.hexagonal,
        "d4": lattices.d4,
        "e8": lattices.e8,
    }[name]()


def _timed(fn, *args):
    """``(wall seconds, process CPU seconds)`` of one call (waited for)."""
    import jax

    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, time.process_time() - c0


def _check_error(name: str, err, family: str, level: float) -> tuple[float, float, float]:
    """``(mean, std, expected std)`` of a decoded error; raises ``RuntimeError`` when the mean is not
    ≈ 0 or the std not ≈ the noise's (5 standard errors, the sample std's SE being
    ``std·sqrt((E z^4/σ^4 − 1)/d)/2``)."""
    import numpy as np

    err = np.asarray(err, np.float64)
    d = err.shape[0]
    target = level if family == "gaussian" else math.sqrt(2.0) * level
    mean, std = float(err.mean()), float(err.std())
    std_tol = 5.0 * target * math.sqrt(_KURTOSIS_MINUS_ONE[family] / d) / 2.0
    mean_tol = 5.0 * target / math.sqrt(d)
    if not (np.all(np.isfinite(err)) and abs(std - target) <= std_tol and abs(mean) <= mean_tol):
        raise RuntimeError(
            f"{name}: decoded error is not {family} noise of std {target:.4g}: mean {mean:.4g} "
            f"(tolerance {mean_tol:.3g}), std {std:.4g} (tolerance {std_tol:.3g}), "
            f"finite {bool(np.all(np.isfinite(err)))}"
        )
    return mean, std, target


def _case_fns(lattice, noise, d: int, sigma_or_b: float, family: str):
    """The jitted functions of one case."""
    import jax
    import jax.numpy as jnp

    from sidejax.coding.lattice import clip_update, lrsuq_coder, lrsuq_quantize, lrsuq_reconstruct
    from sidejax.distributions import PointMass

    coder = clip_update(lrsuq_coder(lattice, noise), gamma=1.0)
    zeros = PointMass(jnp.zeros((d,), jnp.float32))
    state = coder.init(d)
    draw = jax.random.normal if family == "gaussian" else jax.random.laplace
    return {
        "quantize": jax.jit(lambda key, x: lrsuq_quantize(key, x, lattice, noise)),
        "reconstruct": jax.jit(lambda key, h, c: lrsuq_reconstruct(key, h, c, lattice, noise, d)),
        "encode": jax.jit(lambda keys, x: coder.encode(keys, PointMass(x), zeros, state)),
        "decode": jax.jit(lambda key, message: coder.decode(key, zeros, state, message)),
        "baseline": jax.jit(lambda key, x: x + sigma_or_b * draw(key, x.shape, jnp.float32)),
    }


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.cepam_quantize", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--dim", type=int, nargs="+", default=[DEFAULT_DIM], help="vector size(s) (default 25818)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions of each step (best kept)")
    parser.add_argument("--sigma", type=float, default=0.1, help="Gaussian noise std (default 0.1)")
    parser.add_argument("--b", type=float, default=0.1, help="Laplace noise scale (default 0.1)")
    parser.add_argument(
        "--lattices",
        nargs="+",
        choices=LATTICES,
        default=list(LATTICES),
        help="lattices to run (default all)",
    )
    parser.add_argument("--out", default="results/bench/cepam_quantize.json", help="JSON output path")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if any(d < 1 for d in args.dim):
        parser.error(f"--dim must be >= 1, got {args.dim}")
    if not (math.isfinite(args.sigma) and args.sigma > 0 and math.isfinite(args.b) and args.b > 0):
        parser.error("--sigma and --b must be finite and > 0")
    return args


def _first_calls(f, keys, noise_key, x):
    """Times each step's first call (compilation included) and runs it again for its outputs; returns
    ``(first-call wall seconds, outputs)``."""
    first, o = {}, {}
    first["quantize"], _ = _timed(f["quantize"], keys.shared, x)
    o["h"], o["coords"] = f["quantize"](keys.shared, x)
    first["reconstruct"], _ = _timed(f["reconstruct"], keys.shared, o["h"], o["coords"])
    o["x_hat"] = f["reconstruct"](keys.shared, o["h"], o["coords"])
    first["encode"], _ = _timed(f["encode"], keys, x)
    o["message"], o["info"] = f["encode"](keys, x)
    first["decode"], _ = _timed(f["decode"], keys.shared, o["message"])
    o["y"], o["decoded"] = f["decode"](keys.shared, o["message"])
    first["baseline"], _ = _timed(f["baseline"], noise_key, x)
    o["z"] = f["baseline"](noise_key, x)
    return first, o


def _case(cname, lattice, noise, family, level, d, f, keys, noise_key, x) -> dict:
    """One case's checked quality numbers and first-call times, plus ``_args`` (each step's arguments for
    the timed calls, removed before the report)."""
    import jax.numpy as jnp

    from sidejax.coding.lattice import num_blocks
    from sidejax.coding.lrsuq import acceptance_probability

    first, o = _first_calls(f, keys, noise_key, x)
    h, info, decoded, message = o["h"], o["info"], o["decoded"], o["message"]
    if not (bool(jnp.all(h > 0)) and bool(info.valid) and bool(decoded.valid)):
        raise RuntimeError(
            f"{cname}: invalid encoding (all h > 0: {bool(jnp.all(h > 0))}, encoder valid "
            f"{bool(info.valid)}, decoder valid {bool(decoded.valid)}, errors {int(decoded.errors)})"
        )
    q_mean, q_std, target = _check_error(f"{cname} quantize/reconstruct", o["x_hat"] - x, family, level)
    _, c_std, _ = _check_error(f"{cname} coder round trip", o["y"] - x, family, level)
    _, b_std, _ = _check_error(f"{cname} baseline", o["z"] - x, family, level)
    p = acceptance_probability(lattice, noise)
    return {
        "lattice": lattice.name,
        "lattice_dim": lattice.dim,
        "noise": family,
        "level": level,
        "blocks": num_blocks(d, lattice),
        "acceptance_probability": p,
        "expected_mean_trials": 1.0 / p,
        "mean_trials": float(info.inner.mean_trials),
        "max_trials": int(jnp.max(h)),
        "bits_per_coordinate": float(message.num_bits) / d,
        "expected_error_std": target,
        "error_mean": q_mean,
        "error_std": q_std,
        "round_trip_error_std": c_std,
        "baseline_error_std": b_std,
        "first_call_wall_seconds": first,
        "_args": {
            "quantize": (keys.shared, x),
            "reconstruct": (keys.shared, h, o["coords"]),
            "encode": (keys, x),
            "decode": (keys.shared, message),
            "baseline": (noise_key, x),
        },
    }


def _time_cases(cases, fns, repeats: int, d: int) -> None:
    """Best-of-``repeats`` wall and CPU seconds of every step, cases interleaved; adds them, the coordinates
    per second and the slowdowns against noise addition to each case (and drops its ``_args``)."""
    inf = (float("inf"), float("inf"))
    best = {c: {s: inf for s in STEPS if s != "round_trip"} for c in cases}
    for _ in range(repeats):
        for cname, case in cases.items():  # interleaved, so load changes hit every case alike
            for step, step_args in case["_args"].items():
                best[cname][step] = tuple(map(min, best[cname][step], _timed(fns[cname][step], *step_args)))
    for cname, case in cases.items():
        del case["_args"]
        for i, clock in enumerate(("wall", "cpu")):
            sec = {s: v[i] for s, v in best[cname].items()}
            sec["round_trip"] = sec["encode"] + sec["decode"]
            case[f"{clock}_seconds"] = sec
            case[f"{clock}_coords_per_second"] = {s: d / t if t > 0 else None for s, t in sec.items()}
            case[f"{clock}_slowdown_vs_baseline"] = {
                s: sec[s] / sec["baseline"] if sec["baseline"] > 0 else None
                for s in ("quantize", "reconstruct", "round_trip")
            }


def main(argv=None) -> dict:
    args = _parse_args(argv)
    import jax
    import jax.numpy as jnp

    from sidejax.coding.lrsuq import GaussianNoise, LaplaceNoise
    from sidejax.keys import client_keys, draw_key, round_key

    keys = client_keys(round_key(jax.random.key(0), 0), 0)
    noise_key = draw_key(keys.private, 0)  # the baseline's private noise (as additive_noise_coder draws it)
    specs = []
    for name in args.lattices:
        specs.append((name, "gaussian", GaussianNoise(args.sigma), args.sigma))
        if name == "z1":
            specs.append((name, "laplace", LaplaceNoise(args.b), args.b))

    results = {}
    for d in args.dim:
        x = jax.random.normal(jax.random.key(1), (d,), jnp.float32) / math.sqrt(d)
        x = x / jnp.linalg.norm(x)
        cases = {}
        fns = {}
        for lname, family, noise, level in specs:
            lattice = _lattice(lname)
            cname = f"{lattice.name}-{family}"
            fns[cname] = _case_fns(lattice, noise, d, level, family)
            cases[cname] = _case(cname, lattice, noise, family, level, d, fns[cname], keys, noise_key, x)
        _time_cases(cases, fns, args.repeats, d)
        results[str(d)] = cases

    result = {
        "machine": machine_record(),
        "dims": list(args.dim),
        "sigma": args.sigma,
        "b": args.b,
        "gamma": 1.0,
        "repeats": args.repeats,
        "lattices": list(args.lattices),
        "results": results,
    }
    write_report(result, args.out, table=format_table(result))
    return result


def format_table(result: dict) -> str:
    """The readable table of a result (wall time; Mcoord/s and slowdown vs. noise addition)."""
    lines = []
    for d, cases in result["results"].items():
        lines.append(
            f"d = {int(d):,}: wall time, best of {result['repeats']}; Mcoord/s (slowdown vs. noise addition)"
        )
        head = (
            f"{'case':<14} {'h mean':>6} {'h max':>5} {'bits/c':>6} {'err std':>7} "
            f"{'quantize':>15} {'reconstruct':>15} {'round trip':>15} {'noise add':>9}"
        )
        lines.append(head)
        lines.append("-" * len(head))
        for cname, c in cases.items():
            rate = c["wall_coords_per_second"]
            slow = c["wall_slowdown_vs_baseline"]

            def cell(step, rate=rate, slow=slow):
                return f"{rate[step] / 1e6:7.2f} ({slow[step]:4.0f}x)"

            lines.append(
                f"{cname:<14} {c['mean_trials']:6.2f} {c['max_trials']:5d} {c['bits_per_coordinate']:6.2f} "
                f"{c['error_std']:7.4f} {cell('quantize'):>15} {cell('reconstruct'):>15} "
                f"{cell('round_trip'):>15} {rate['baseline'] / 1e6:9.1f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
