"""Benchmark: importance-sampling coder throughput and peak memory vs the candidate-generation floor.

For each ``d`` (default: LeNet5's 61,706 and 6CNN's 2,262,602 parameters) and ``K = 2**log2k`` candidates
per block (default 256), in a fresh subprocess (so peak RSS is clean), it times on the default backend,
interleaved, best of ``--repeats``:

- ``floor``: generating the ``K x d`` candidate uniforms with ``jax.random.uniform`` and reducing them to one
  number (so nothing else is computed and they need not be stored), in the same coordinate chunks as the
  encoder uses;
- ``floor_counter``: the candidates the coder itself generates, from its own counter-based uniforms and
  candidate function, reduced (:func:`experiments.bench.common.candidate_floor`): the tighter floor for this
  design; an encode CPU time below it is refused (:func:`experiments.bench.common.check_above_floor`);
- ``floor_threefry``: the same ``K x d`` uniforms as stream format 1 generated them (one Threefry-2x32
  block per coordinate pair, both words used), reduced: what the counter hash replaced, with
  ``encode_format1``, the same encoder traced with format 1's uniforms (the speed-up in one process);
- ``encode``: :func:`sidejax.coding.importance_encode` (Bernoulli q vs p = 0.5, fixed blocks of 64);
- ``decode``: :func:`sidejax.coding.importance_decode`.

Reports coordinates per second, ``(encode + decode) / floor`` (target: within 2x), the peak resident
memory of the subprocess, every contestant's wall and CPU time, and the machine, threads and load average
before and after, as JSON (default ``results/bench/importance_coder.json``). XLA runs with its default
threads here: compare CPU times, or pin the run (``taskset -c 0 python -m ...``; the children inherit it).

Run: ``python -m experiments.bench.importance_coder [--dims 61706,2262602] [--log2k 8]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

from experiments.bench.common import (
    best,
    candidate_floor,
    check_above_floor,
    child_json,
    interleave,
    load_average,
    machine_record,
    parser,
    timing,
    write_report,
)

#: the command line: flag -> (type, default, help)
FLAGS = {
    "--dims": (str, "61706,2262602", "comma-separated sizes"),
    "--log2k": (int, 8, None),
    "--repeats": (int, 3, None),
    "--memory-budget-mb": (int, 256, None),
    "--output": (Path, Path("results/bench/importance_coder.json"), None),
    "--single": (int, None, argparse.SUPPRESS),
}


def run_single(dim: int, log2k: int, repeats: int, memory_budget_mb: int) -> dict:
    from unittest import mock

    import jax
    import jax.numpy as jnp
    from jax.extend.random import threefry_2x32

    from sidejax.blocks import fixed_blocks
    from sidejax.coding import importance
    from sidejax.coding.importance import (
        choose_chunk_size,
        importance_decode,
        importance_encode,
    )
    from sidejax.distributions import Bernoulli, bits_to_open_uniform

    K = 2**log2k
    chunk = choose_chunk_size(dim, K, memory_budget_mb * 2**20)
    num_chunks = -(-dim // chunk)
    q = Bernoulli(jax.random.uniform(jax.random.key(1), (dim,), minval=0.05, maxval=0.95))
    p = Bernoulli(jnp.full((dim,), 0.5))
    blocks = fixed_blocks(dim, 64)
    sk, pk = jax.random.key(2), jax.random.key(3)

    @jax.jit
    def floor(key):
        def step(acc, c):
            return acc + jnp.sum(jax.random.uniform(jax.random.fold_in(key, c), (K, chunk))), None

        return jax.lax.scan(step, jnp.float32(0), jnp.arange(num_chunks))[0]

    floor_counter = candidate_floor(p, K, chunk)  # the coder's own candidates, reduced

    def format1_uniforms(key, num_candidates, start, length):
        """Stream format 1's ``[K, length]`` candidate uniforms (the coder before the counter hash): word
        ``j % 2`` of ``threefry_2x32(key_data, (k, j // 2))``; ``start`` and ``length`` even."""
        half = length // 2
        k = jnp.broadcast_to(jnp.arange(num_candidates, dtype=jnp.uint32)[:, None], (num_candidates, half))
        h = jnp.broadcast_to((start // 2 + jnp.arange(half)).astype(jnp.uint32)[None, :], k.shape)
        words = threefry_2x32(jax.random.key_data(key), jnp.concatenate([k.reshape(-1), h.reshape(-1)]))
        n = num_candidates * half
        w = jnp.stack([words[:n].reshape(k.shape), words[n:].reshape(k.shape)], axis=-1)
        return bits_to_open_uniform(w.reshape(num_candidates, length))

    @jax.jit
    def floor_threefry(key):  # stream format 1's candidate uniforms, reduced
        def step(acc, c):
            return acc + jnp.sum(format1_uniforms(key, K, c * chunk, chunk)), None

        return jax.lax.scan(step, jnp.float32(0), jnp.arange(num_chunks))[0]

    def encode_fn(s, r):
        return importance_encode(s, r, q, p, blocks, log2_num_candidates=log2k, chunk_size=chunk)[0]

    encode = jax.jit(encode_fn)
    # the same encoder traced with format 1's uniforms: the coder as it was, for the speed-up in one process
    # (a function of its own: jax caches traces by function, and this one must not share encode's)
    with mock.patch.object(importance, "chunk_uniforms", format1_uniforms):
        encode_format1 = jax.jit(lambda s, r: encode_fn(s, r)).lower(sk, pk).compile()
    decode = jax.jit(lambda s, idx: importance_decode(s, p, blocks, idx))
    idx = encode(sk, pk)
    calls = {
        "floor": lambda: floor(sk),
        "floor_counter": lambda: floor_counter(sk),
        "floor_threefry": lambda: floor_threefry(sk),
        "encode": lambda: encode(sk, pk),
        "encode_format1": lambda: encode_format1(sk, pk),
        "decode": lambda: decode(sk, idx),
    }
    interleave(calls, 1)  # compile + warm up
    times = interleave(calls, repeats)[0]
    t = {name: wall for name, (wall, _) in best(times).items()}
    # the floor check compares CPU times on the CPU (steady under load); on an accelerator the host's CPU
    # time says nothing of the device's work, so wall times there
    basis = "cpu" if jax.default_backend() == "cpu" else "wall"
    checked = {name: (c if basis == "cpu" else w) for name, (w, c) in best(times).items()}
    t_floor, t_floor_counter, t_enc, t_dec = t["floor"], t["floor_counter"], t["encode"], t["decode"]
    t_threefry, t_enc1 = t["floor_threefry"], t["encode_format1"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "dim": dim,
        "num_candidates": K,
        "chunk_size": chunk,
        "num_chunks": num_chunks,
        "floor_s": t_floor,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "encode_decode_s": t_enc + t_dec,
        "floor_counter_s": t_floor_counter,
        "floor_threefry_s": t_threefry,
        "threefry_over_counter": t_threefry / t_floor_counter,
        "encode_format1_s": t_enc1,
        "encode_speedup_over_format1": t_enc1 / t_enc,
        "ratio_to_floor": (t_enc + t_dec) / t_floor,
        "ratio_to_counter_floor": (t_enc + t_dec) / t_floor_counter,
        "coords_per_s_encode_decode": dim / (t_enc + t_dec),
        "candidate_evals_per_s_floor": K * dim / t_floor,
        "floor_check_time": basis,
        "encode_over_counter_floor": check_above_floor(
            f"encode (d = {dim}, K = {K}, {basis} time)", checked["encode"], checked["floor_counter"]
        ),
        "timing": {name: timing(v) for name, v in times.items()},
        "peak_rss_mb": peak_mb,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser("experiments.bench.importance_coder", __doc__, FLAGS)
    args = p.parse_args(argv)
    load_before = load_average()
    if args.single is not None:
        print(json.dumps(run_single(args.single, args.log2k, args.repeats, args.memory_budget_mb)))
        return {}
    rows = []
    for dim in (int(x) for x in args.dims.split(",")):
        cmd = [sys.executable, "-m", "experiments.bench.importance_coder", "--single", str(dim)]
        cmd += ["--log2k", str(args.log2k), "--repeats", str(args.repeats)]
        row = child_json(cmd + ["--memory-budget-mb", str(args.memory_budget_mb)])
        rows.append(row)
        print(
            f"d={dim:>9,} K={row['num_candidates']}: encode {row['encode_s']:.3f}s "
            f"decode {row['decode_s']:.4f}s "
            f"floor {row['floor_s']:.3f}s (counter floor {row['floor_counter_s']:.3f}s) -> (enc+dec)/floor = "
            f"{row['ratio_to_floor']:.2f}x ({row['ratio_to_counter_floor']:.2f}x of counter floor), "
            f"{row['coords_per_s_encode_decode']:.3e} coords/s, peak RSS {row['peak_rss_mb']:.0f} MB"
        )
    report = {
        "benchmark": "importance_coder",
        "log2_num_candidates": args.log2k,
        "memory_budget_mb": args.memory_budget_mb,
        "target_ratio_to_floor": 2.0,
        "machine": machine_record(load_before=load_before),
        "results": rows,
    }
    write_report(report, args.output, trailing_newline=False)
    return report


if __name__ == "__main__":
    main()
