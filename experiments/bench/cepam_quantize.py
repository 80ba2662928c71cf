"""Benchmark: throughput of CEPAM's LRSUQ (quantization whose error *is* the Gaussian / Laplace DP noise)
per lattice, against plain noise addition (the same output law, without compression) and against a
vectorised numpy implementation of the same algorithm with the same streams.

For a vector ``x`` of ``--dim`` coordinates (default 25,818, the CEPAM MLP; several sizes may be given),
``x ~ N(0, I/d)`` normalised to norm 1, and the paper's noise levels ``σ = b = 0.1``, each case (a lattice
and a noise family) times, after a warm-up call, in one process, interleaved over cases and steps and best
of ``--repeats``:

- ``quantize``: :func:`sidejax.coding.lattice.lrsuq_quantize` ``(shared_key, x, lattice, noise) ->
  (h, coords)`` (trials ``1 … T0`` for every block, then the stragglers gathered and finished by the
  per-block ``lax.while_loop``), jitted;
- ``reconstruct``: :func:`sidejax.coding.lattice.lrsuq_reconstruct` (the decoder's regeneration of the
  latents and the accepted dithers), jitted;
- ``encode`` / ``decode``: the full coder with real bitstreams, jitted,
  ``c = clip_update(lrsuq_coder(lattice, noise), gamma=1.0)``, ``c.encode(keys, PointMass(x),
  PointMass(0), c.init(d))`` and ``c.decode(keys.shared, PointMass(0), c.init(d), message)``;
  ``round_trip`` is their sum (bits per coordinate ``num_bits / d`` and the mean trial index reported);
- ``baseline``: ``x + σ·N(0, 1)`` (``jax.random.normal``) or ``x + b·Lap(0, 1)`` (``jax.random.laplace``),
  jitted: what a user who does not compress runs to get the same output law;
- ``numpy_encode`` / ``numpy_decode`` (``Z^1``, ``Z^2``, ``Z^3``: the paper's lattices), and
  ``numpy_round_trip`` their sum: :class:`NumpyLRSUQ`, the algorithm written again in vectorised numpy from
  docs/papers/cepam.md (not by calling sidejax), with the stream format of sidejax (its writer produces
  sidejax's words bit for bit from the same ``(h, coords)``, tested) and numpy's own generator (PCG64)
  as the shared randomness, read in the same order by both ends (the paper's "identical seeds give
  identical PRNG outputs"); sidejax instead reads its latents and dithers from the counter hash at (draw,
  block) and (trial, coordinate) (stream format 3), which its exact vectorised sampler and the decoder's
  jump to trial ``h`` need.

Lattices ``Z^1, Z^2, Z^3, A2, D4, E8`` with ``GaussianNoise(σ)``; ``LaplaceNoise(b)`` on ``Z^1`` only
(LRSUQ's Laplace layering needs a one-dimensional lattice). Reported: coordinates per second of each step,
``slowdown`` = LRSUQ time / baseline time (how many times slower than plain noise addition), and
``speedup_vs_numpy`` = numpy round trip / sidejax round trip, each by wall and by process CPU time (all
threads; on a shared machine the steadier of the two). The run fails loudly (``RuntimeError``) unless every
decoded stream is valid and the decoded error, of sidejax and of the numpy reference alike, has mean ≈ 0
and std ≈ ``σ`` (Gaussian) or ``√2·b`` (Laplace), within 5 standard errors of the sample std.

``--pin-core N`` pins the process to core ``N`` and sets XLA's single-thread flags
(:data:`experiments.bench.common.SINGLE_THREAD_XLA_FLAGS`; effective when jax is not imported yet): numpy
runs on one thread, so this is the like-for-like comparison. The JSON records what the run used
(``threads``: the pinned core, the usable cores, the XLA flags), the load average before and after
(``load_average_before``, ``machine.load_average_after``) and the process CPU time of the whole run.

Writes JSON (default ``results/bench/cepam_quantize.json``) with the machine (``jax.devices()``, CPU
count), the sizes and every case's wall and CPU seconds, and prints a table.

Run: ``python -m experiments.bench.cepam_quantize [--dim 25818 ...] [--repeats 5] [--pin-core 0]``.

Measurements: docs/benchmarks.md#cepams-quantizer-vs-plain-noise-addition.
"""

from __future__ import annotations

import functools
import math

from experiments.bench import common
from experiments.bench.common import best, clock, interleave, machine_record, parser, text_table, write_report

DEFAULT_DIM = 25_818  # the CEPAM MLP
LATTICES = ("z1", "z2", "z3", "a2", "d4", "e8")
STEPS = ("quantize", "reconstruct", "encode", "decode", "round_trip", "baseline")
#: the numpy reference's steps (the lattices it has: Z^1, Z^2, Z^3)
NUMPY_STEPS = ("numpy_encode", "numpy_decode", "numpy_round_trip")
NUMPY_LATTICES = ("z1", "z2", "z3")
#: the shared seed of the numpy reference's generator (both ends)
NUMPY_SEED = 7
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
    numpy_fns = {}
    if lattice.kind == "Z" and lattice.dim <= 3 and lattice.scale == 1.0:
        ref = NumpyLRSUQ(lattice.dim, family, sigma_or_b)
        numpy_fns = {
            "numpy_encode": ref.encode,
            "numpy_decode": lambda seed, words, num_bits: ref.decode(seed, words, num_bits, d),
        }
    return numpy_fns | {
        "quantize": jax.jit(lambda key, x: lrsuq_quantize(key, x, lattice, noise)),
        "reconstruct": jax.jit(lambda key, h, c: lrsuq_reconstruct(key, h, c, lattice, noise, d)),
        "encode": jax.jit(lambda keys, x: coder.encode(keys, PointMass(x), zeros, state)),
        "decode": jax.jit(lambda key, message: coder.decode(key, zeros, state, message)),
        "baseline": jax.jit(lambda key, x: x + sigma_or_b * draw(key, x.shape, jnp.float32)),
    }


# ----------------------------------------------------------------------------------------------------
# The numpy reference: the same algorithm, written from docs/papers/cepam.md (not by calling sidejax)


class NumpyLRSUQ:
    """LRSUQ with real streams in vectorised numpy, from docs/papers/cepam.md#s2-4 (Definition 4), #s2-5
    (the Gaussian and Laplace latents), #s2-7/#s2-8 (Algorithms 2 and 3) and #s2-10 (the stream), for
    ``Z^n`` (the paper's lattices, ``n`` = 1, 2, 3; ``ρ = 1/2``, ``Q(y) = floor(y + 1/2)``).

    Shared randomness as the paper has it: one generator (numpy's PCG64) seeded with the shared seed, read
    in the same order by both ends (docs/papers/cepam.md#s2-9: "identical seeds give identical PRNG
    outputs", the dithers drawn one after another): the latents of all ``N`` blocks (``n + 2`` standard
    normals each, summed in squares: ``χ²_{n+2}``; or two uniforms, ``−log u₁ − log u₂``: ``Gamma(2, 1)``),
    then trial ``t``'s dithers ``Unif[−1/2, 1/2)^n`` for the blocks still open after trial ``t − 1``, in
    block order. The decoder knows every ``h_j``, hence which blocks were open at each trial, so it replays
    the same draws and keeps each block's accepted one. float32 arrays throughout, like sidejax.

    The stream is sidejax's format (docs/papers/cepam.md#s2-10): the ``N`` Golomb codewords of ``h_j − 1``
    (parameter ``ceil(log(2 − p)/(−log(1 − p)))``, none when ``p = 1``), the header (number of nonzero
    coordinates and the run-length parameter, ``(N n).bit_length()`` bits each), then per nonzero coordinate
    the Golomb code of the zeros before it, the Elias-gamma code of ``|c|`` and a sign bit, most significant
    bit first, packed LSB-first into little-endian uint32 words. The writer expands every codeword into
    its bits at once (``np.repeat``) and packs them (``np.packbits``); the reader computes every
    codeword's length at every bit position of the sent stream (vectorised), follows the chain of codeword
    starts by pointer doubling (``log₂`` of the symbol count rounds over the positions; a sequential walk
    in Python would be slower) and reads the values at the starts.
    """

    def __init__(self, n: int, family: str, level: float):
        if n not in (1, 2, 3) or family not in ("gaussian", "laplace") or (family == "laplace" and n != 1):
            raise ValueError(f"the numpy reference has Z^1..Z^3 (Laplace: Z^1), got n={n}, {family}")
        self.n, self.family, self.level = n, family, float(level)
        p = 1.0 if family == "laplace" else math.pi ** (n / 2) / math.gamma(n / 2 + 1) * 0.5**n
        self.p = 1.0 if abs(p - 1.0) < 1e-12 else p
        self.trial_m = (
            0 if self.p >= 1.0 else max(1, math.ceil(math.log(2.0 - self.p) / -math.log1p(-self.p)))
        )

    def _latent_beta(self, rng, blocks: int):
        import numpy as np

        if self.family == "gaussian":
            u = np.square(rng.standard_normal((blocks, self.n + 2), dtype=np.float32)).sum(axis=1)
            r = np.float32(self.level) * np.sqrt(np.maximum(u, np.finfo(np.float32).tiny))
        else:
            v = 1.0 - rng.random((blocks, 2), dtype=np.float32)  # (0, 1]
            u = -np.log(v).sum(axis=1)
            r = np.float32(self.level) * np.maximum(u, np.finfo(np.float32).tiny)
        return r / np.float32(0.5)  # β = r/ρ

    def encode(self, seed: int, x):
        """``(words uint32, num_bits)`` of the vector ``x [d]`` (float32)."""
        import numpy as np

        n = self.n
        d = x.shape[0]
        blocks = -(-d // n)
        xb = np.zeros(blocks * n, np.float32)
        xb[:d] = x
        xb = xb.reshape(blocks, n)
        rng = np.random.Generator(np.random.PCG64(seed))
        xs = xb / self._latent_beta(rng, blocks)[:, None]
        h = np.zeros(blocks, np.int64)
        coords = np.zeros((blocks, n), np.int64)
        open_ = np.arange(blocks)
        t = 0
        while open_.size:
            t += 1
            y = xs[open_] - (rng.random((open_.size, n), dtype=np.float32) - np.float32(0.5))
            m = np.floor(y + np.float32(0.5))
            ok = np.square(m - y).sum(axis=1) <= np.float32(0.25)
            h[open_[ok]] = t
            coords[open_[ok]] = m[ok]
            open_ = open_[~ok]
        return self._write(h, coords.reshape(-1))

    def decode(self, seed: int, words, num_bits: int, d: int):
        """``x̂ [d]`` from a stream of :meth:`encode` (raises ``ValueError`` on a malformed stream)."""
        import numpy as np

        n = self.n
        blocks = -(-d // n)
        h, flat = self._read(words, num_bits, blocks)
        rng = np.random.Generator(np.random.PCG64(seed))
        beta = self._latent_beta(rng, blocks)
        v = np.zeros((blocks, n), np.float32)
        for t in range(1, int(h.max()) + 1):  # replay trial t's draws for the blocks open at trial t
            open_ = np.flatnonzero(h >= t)
            draw = rng.random((open_.size, n), dtype=np.float32) - np.float32(0.5)
            at = h[open_] == t
            v[open_[at]] = draw[at]
        x_hat = beta[:, None] * (flat.reshape(blocks, n).astype(np.float32) + v)
        return x_hat.reshape(-1)[:d]

    # -- the stream --------------------------------------------------------------------------------

    @staticmethod
    def _golomb(values, m: int):
        """(value, length) of Golomb codewords of ``values >= 0`` with parameter ``m``."""
        import numpy as np

        b = (m - 1).bit_length()
        u = (1 << b) - m
        q, r = np.divmod(values, m)
        short = r < u
        rem_len = np.where(short, b - 1, b)
        rem = np.where(short, r, r + u)
        return (np.int64(1) << rem_len) | rem, q + 1 + rem_len

    def _write(self, h, flat):
        import numpy as np

        dim = flat.shape[0]
        width = dim.bit_length()
        nz = np.flatnonzero(flat)
        k = nz.size
        pk = min(max(k / dim, 1.0 / dim), 1.0 - 1.0 / (2.0 * dim))
        m = 1 if k == 0 else int(min(max(math.ceil(math.log(2.0 - pk) / -math.log1p(-pk)), 1), dim))
        runs = np.diff(nz, prepend=-1) - 1
        run_v, run_l = self._golomb(runs, m)
        mag = np.abs(flat[nz])
        mag_l = 2 * (np.frexp(mag.astype(np.float64))[1] - 1) + 1  # 2 floor(log2 |c|) + 1
        sym_v = np.stack([run_v, mag, (flat[nz] < 0).astype(np.int64)], axis=1).reshape(-1)
        sym_l = np.stack([run_l, mag_l, np.ones_like(mag_l)], axis=1).reshape(-1)
        parts_v, parts_l = [np.array([k, m]), sym_v], [np.array([width, width]), sym_l]
        if self.trial_m:
            tv, tl = self._golomb(h - 1, self.trial_m)
            parts_v.insert(0, tv)
            parts_l.insert(0, tl)
        values, lengths = np.concatenate(parts_v), np.concatenate(parts_l)
        total = int(lengths.sum())
        owner = np.repeat(np.arange(values.size), lengths)
        shift = np.repeat(np.cumsum(lengths), lengths) - 1 - np.arange(total)  # bit index in the value
        bits = np.where(shift < 63, (values[owner] >> np.minimum(shift, 62)) & 1, 0).astype(np.uint8)
        packed = np.packbits(bits, bitorder="little")
        words = np.zeros(-(-total // 32) * 4, np.uint8)
        words[: packed.size] = packed
        return words.view("<u4"), total

    def _read(self, words, num_bits: int, blocks: int):
        import numpy as np

        dim = blocks * self.n
        width = dim.bit_length()
        bits = np.unpackbits(np.asarray(words, "<u4").view(np.uint8), bitorder="little")[:num_bits]
        pad = np.concatenate([bits, np.zeros(160, np.uint8)]).astype(np.int64)
        ones = np.append(np.flatnonzero(pad), num_bits + 64)  # a sentinel 1 past the end

        def next_one(p):  # the first 1-bit at or after p (the sentinel if none)
            return ones[np.minimum(np.searchsorted(ones, p), ones.size - 1)]

        pos = np.arange(num_bits)
        win = np.zeros(num_bits + 128, np.int64)  # the 32 bits from each position, first bit most significant
        for t in range(32):
            win |= pad[t : t + num_bits + 128] << (31 - t)

        def golomb_at(p, m):
            b = (m - 1).bit_length()
            u = (1 << b) - m
            one = next_one(p)
            q = one - p
            x = win[one + 1] >> (32 - b + 1) if b > 1 else np.zeros_like(p)
            long = x >= u
            y = win[one + 1] >> (32 - b) if b > 0 else np.zeros_like(p)
            rem_len = np.where(long, b, max(b - 1, 0))
            return q * m + np.where(long, y - u, x), q + 1 + rem_len

        def chain(length, start, count):
            # pointer doubling over positions 0..num_bits (num_bits: the end; num_bits + 1: overrun)
            nxt = np.minimum(pos + length, num_bits + 1)
            jump = np.concatenate([nxt, [num_bits, num_bits + 1]])
            marked = np.zeros(num_bits + 2, bool)
            marked[start] = True
            for _ in range(max(1, math.ceil(math.log2(count + 2)))):
                marked[jump[marked]] = True
                jump = jump[jump]
            return np.flatnonzero(marked[:num_bits]), marked[num_bits], marked[num_bits + 1]

        if self.trial_m:
            tv, tl = golomb_at(pos, self.trial_m)
            starts, _, _ = chain(tl, 0, blocks)
            starts = starts[:blocks]
            h = tv[starts] + 1
            h_end = int(starts[-1] + tl[starts[-1]])
        else:
            h, h_end = np.ones(blocks, np.int64), 0
        k = int(win[h_end] >> (32 - width))
        m = int(win[h_end + width] >> (32 - width))
        sym = np.arange(h_end + 2 * width, num_bits)
        run, rl = golomb_at(sym, m)
        z = np.clip(next_one(sym + rl) - (sym + rl), 0, 31)
        rl = np.minimum(rl, num_bits)
        mag = win[sym + rl + z] >> (31 - np.minimum(z, 31))
        length = np.zeros(num_bits, np.int64)
        length[sym] = rl + 2 * z + 2
        starts, ends_exactly, _ = chain(length, h_end + 2 * width, k)
        starts = starts[starts >= h_end + 2 * width]
        if starts.size != k or not ends_exactly:
            raise ValueError("malformed stream")
        i = starts - (h_end + 2 * width)
        sign = pad[starts + rl[i] + 2 * z[i] + 1]
        flat = np.zeros(dim, np.int64)
        flat[np.cumsum(run[i] + 1) - 1] = np.where(sign == 1, -mag[i], mag[i])
        return h, flat


#: the command line: flag -> (type, default, help)
FLAGS = {
    "--dim": ([int], [DEFAULT_DIM], "vector size(s)"),
    "--repeats": (int, 5, "timed repetitions of each step (best kept)"),
    "--sigma": (float, 0.1, "Gaussian noise std"),
    "--b": (float, 0.1, "Laplace noise scale"),
    "--lattices": ([str], list(LATTICES), f"lattices to run, of {' '.join(LATTICES)}"),
    "--pin-core": (int, None, "pin the process to this CPU core, XLA single-threaded (default: neither)"),
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
    import numpy as np

    first, o = {}, {}

    def call(step, *args):
        out, first[step], _ = clock(f[step], *args)
        return out

    o["h"], o["coords"] = call("quantize", keys.shared, x)
    o["x_hat"] = call("reconstruct", keys.shared, o["h"], o["coords"])
    o["message"], o["info"] = call("encode", keys, x)
    o["y"], o["decoded"] = call("decode", keys.shared, o["message"])
    o["z"] = call("baseline", noise_key, x)
    if "numpy_encode" in f:
        x_np = np.asarray(x)
        o["np_message"] = call("numpy_encode", NUMPY_SEED, x_np)
        o["np_y"] = call("numpy_decode", NUMPY_SEED, *o["np_message"])
    return first, o


def _case(cname, lattice, noise, family, level, d, f, keys, noise_key, x) -> dict:
    """One case's checked quality numbers and first-call times, plus ``_args`` (each step's arguments for
    the timed calls, removed before the report)."""
    import jax.numpy as jnp
    import numpy as np

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
    args = {
        "quantize": (keys.shared, x),
        "reconstruct": (keys.shared, h, o["coords"]),
        "encode": (keys, x),
        "decode": (keys.shared, message),
        "baseline": (noise_key, x),
    }
    numpy_ref = None
    if "np_y" in o:
        _, np_std, _ = _check_error(
            f"{cname} numpy reference round trip", o["np_y"] - np.asarray(x), family, level
        )
        numpy_ref = {"bits_per_coordinate": o["np_message"][1] / d, "round_trip_error_std": np_std}
        args["numpy_encode"] = (NUMPY_SEED, np.asarray(x))
        args["numpy_decode"] = (NUMPY_SEED, *o["np_message"])
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
        "numpy_reference": numpy_ref,
        "first_call_wall_seconds": first,
        "_args": args,
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
            if "numpy_encode" in sec:
                sec["numpy_round_trip"] = sec["numpy_encode"] + sec["numpy_decode"]
            case[f"{kind}_seconds"] = sec
            case[f"{kind}_coords_per_second"] = {s: d / t if t > 0 else None for s, t in sec.items()}
            case[f"{kind}_slowdown_vs_baseline"] = {
                s: sec[s] / sec["baseline"] if sec["baseline"] > 0 else None
                for s in ("quantize", "reconstruct", "round_trip")
            }
            # how many times faster sidejax's round trip (with streams) is than the numpy reference's
            case[f"{kind}_speedup_vs_numpy"] = (
                sec["numpy_round_trip"] / sec["round_trip"] if "numpy_encode" in sec else None
            )


def _threads(pin_core) -> dict:
    """Pins the process to ``pin_core`` (if given) with XLA's single-thread flags (effective only when jax
    is not imported yet); returns what the run used: the flags in effect, the usable cores, the core."""
    import os
    import sys

    from experiments.bench.common import SINGLE_THREAD_XLA_FLAGS, single_thread_env

    imported = "jax" in sys.modules
    if pin_core is not None:
        os.sched_setaffinity(0, {pin_core})
        if not imported:
            os.environ["XLA_FLAGS"] = single_thread_env()["XLA_FLAGS"]
    flags = os.environ.get("XLA_FLAGS", "")
    return {
        "pinned_core": pin_core,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "xla_flags": flags,
        "xla_single_threaded": SINGLE_THREAD_XLA_FLAGS in flags,
        "jax_imported_before_the_flags": imported,
    }


def main(argv=None) -> dict:
    import time

    args = _parse_args(argv)
    threads = _threads(args.pin_core)
    load_before, cpu_start = common.load_average(), time.process_time()
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
        "threads": threads,
        "process_cpu_seconds": time.process_time() - cpu_start,
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
            f"d = {int(d):,}: wall time, best of {result['repeats']}; Mcoord/s (slowdown vs. noise "
            "addition); round trip speedup over the numpy reference by CPU time"
        )
        columns = [("case", "<14"), ("h mean", "6.2f"), ("h max", "5d"), ("bits/c", "6.2f")]
        columns += [("err std", "7.4f"), ("quantize", ">15"), ("reconstruct", ">15"), ("round trip", ">15")]
        columns += [("noise add", "9.1f"), ("CPU vs numpy", ">12")]
        rows = []
        for cname, c in cases.items():
            rate, slow = c["wall_coords_per_second"], c["wall_slowdown_vs_baseline"]
            steps = ("quantize", "reconstruct", "round_trip")
            cells = [f"{rate[s] / 1e6:7.2f} ({slow[s]:4.0f}x)" for s in steps]
            rows.append(
                [cname, c["mean_trials"], c["max_trials"], c["bits_per_coordinate"], c["error_std"]]
                + [*cells, rate["baseline"] / 1e6]
                + [f"{c['cpu_speedup_vs_numpy']:.2f}x" if c["cpu_speedup_vs_numpy"] else "-"]
            )
        lines += text_table(columns, rows)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
