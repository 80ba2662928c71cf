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

Measurements, and the three changes that made LRSUQ 2-8x faster than its first version:
docs/benchmarks.md#cepams-quantizer-vs-plain-noise-addition.
"""

from __future__ import annotations

import functools
import math

from experiments.bench import common
from experiments.bench.common import best, clock, interleave, machine_record, parser, text_table, write_report

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


#: the command line: flag -> (type, default, help)
FLAGS = {
    "--dim": ([int], [DEFAULT_DIM], "vector size(s)"),
    "--repeats": (int, 5, "timed repetitions of each step (best kept)"),
    "--sigma": (float, 0.1, "Gaussian noise std"),
    "--b": (float, 0.1, "Laplace noise scale"),
    "--lattices": ([str], list(LATTICES), f"lattices to run, of {' '.join(LATTICES)}"),
}


def _parse_args(argv):
    p = parser("experiments.bench.cepam_quantize", __doc__, FLAGS, out="results/bench/cepam_quantize.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if any(d < 1 for d in args.dim):
        p.error(f"--dim must be >= 1, got {args.dim}")
    if not set(args.lattices) <= set(LATTICES):
        p.error(f"--lattices: choose from {' '.join(LATTICES)}, got {' '.join(args.lattices)}")
    if not (math.isfinite(args.sigma) and args.sigma > 0 and math.isfinite(args.b) and args.b > 0):
        p.error("--sigma and --b must be finite and > 0")
    return args


def _first_calls(f, keys, noise_key, x):
    """Times each step's first call (compilation included); returns ``(first-call wall seconds, outputs)``."""
    first, o = {}, {}

    def call(step, *args):
        out, first[step], _ = clock(f[step], *args)
        return out

    o["h"], o["coords"] = call("quantize", keys.shared, x)
    o["x_hat"] = call("reconstruct", keys.shared, o["h"], o["coords"])
    o["message"], o["info"] = call("encode", keys, x)
    o["y"], o["decoded"] = call("decode", keys.shared, o["message"])
    o["z"] = call("baseline", noise_key, x)
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
    """Best-of-``repeats`` wall and CPU seconds of every step, cases and steps interleaved; adds them, the
    coordinates per second and the slowdowns against noise addition to each case (and drops its ``_args``)."""
    calls = {
        (cname, step): functools.partial(fns[cname][step], *step_args)
        for cname, case in cases.items()
        for step, step_args in case.pop("_args").items()
    }
    fastest = best(interleave(calls, repeats)[0])
    for cname, case in cases.items():
        for i, kind in enumerate(("wall", "cpu")):
            sec = {s: v[i] for (c, s), v in fastest.items() if c == cname}
            sec["round_trip"] = sec["encode"] + sec["decode"]
            case[f"{kind}_seconds"] = sec
            case[f"{kind}_coords_per_second"] = {s: d / t if t > 0 else None for s, t in sec.items()}
            case[f"{kind}_slowdown_vs_baseline"] = {
                s: sec[s] / sec["baseline"] if sec["baseline"] > 0 else None
                for s in ("quantize", "reconstruct", "round_trip")
            }


def main(argv=None) -> dict:
    args = _parse_args(argv)
    load_before = common.load_average()
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
        "machine": machine_record(load_before=load_before),
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
        columns = [("case", "<14"), ("h mean", "6.2f"), ("h max", "5d"), ("bits/c", "6.2f")]
        columns += [("err std", "7.4f"), ("quantize", ">15"), ("reconstruct", ">15"), ("round trip", ">15")]
        columns += [("noise add", "9.1f")]
        rows = []
        for cname, c in cases.items():
            rate, slow = c["wall_coords_per_second"], c["wall_slowdown_vs_baseline"]
            steps = ("quantize", "reconstruct", "round_trip")
            cells = [f"{rate[s] / 1e6:7.2f} ({slow[s]:4.0f}x)" for s in steps]
            rows.append(
                [cname, c["mean_trials"], c["max_trials"], c["bits_per_coordinate"], c["error_std"]]
                + [*cells, rate["baseline"] / 1e6]
            )
        lines += text_table(columns, rows)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
