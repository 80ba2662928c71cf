"""Benchmark: BICompFL's hot path (importance-sampled Bernoulli masks, both directions) in sidejax vs a
PyTorch implementation of the same coder, side by side in one run.

The hot path of a BICompFL round is the importance sampling of ``d``-dimensional Bernoulli masks: every
client encodes ``n_UL`` uplink samples, the federator encodes ``n_DL = n n_UL`` downlink samples per client
(PR) or one set for all (GR-Reconst), and every party decodes (GR: each client decodes all ``n`` streams).
Timed here, at LeNet5's ``d = 61,706``:

- ``encode``: ``n_DL`` samples of ``Bern(theta)`` against a prior, as the federator does for one PR
  client (:func:`sidejax.algorithms.bicompfl.encode_samples` with the Fixed-KLMS coder: counter-based
  candidate uniforms, Gumbel-max index choice, chunked in coordinates, jitted);
- ``decode``: the ``n`` streams one GR client decodes in a round (only the chosen candidates are
  regenerated: ``d`` uniforms per sample instead of ``n_IS d``).

The alternative a user has is the PyTorch reference style of Federated-KLMS / FedPM, written here as a fair,
vectorised version (no Python loop over blocks): per sample, all ``n_IS x d`` candidate uniforms from a
``torch.Generator`` seeded by the shared seed, ``X = U < p``, per-block log-weights by a reshape-sum,
``torch.multinomial`` for the index; decoding regenerates the sample's uniforms from the same seed and picks
the chosen rows (a ``torch.Generator`` stream cannot be read at an offset, so the receiver pays for all
``n_IS x d`` uniforms again).

Both single-threaded by default (``--threads 1``; see :mod:`experiments.bench.torch_compare`) and pinned to
the same cores (``--cores``, default one core: :func:`experiments.bench.common.pinned`; XLA's single-thread
flags still leave two threads busy), median of ``--repeats`` runs after a warm-up, each contestant timed in
turn within a repeat, wall and CPU time. Beside them, ``candidate_floor``: the candidates the encode cannot
avoid generating, from the coder's own generator (:func:`experiments.bench.common.candidate_floor`), timed
in the same run; an encode whose CPU time is below a tenth of it is refused with an error
(:func:`experiments.bench.common.check_above_floor`) instead of reported. Writes JSON (default
``results/bench/bicompfl_round.json``) with each configuration's seconds and timing, the machine, threads,
cores and load average before and after, ``encode_over_floor_cpu_time``, and ``torch_over_sidejax_time``
(wall) and ``torch_over_sidejax_cpu_time`` for encode and decode (> 1: sidejax is faster). Two
configurations: the CPU profile of docs/papers/bicompfl.md#s2-3 (blocks of 128, 16 candidates) and its paper
default (blocks of 256, 256 candidates); both are 1/32 bit per parameter.

Run: ``python -m experiments.bench.bicompfl_round [--repeats 5] [--threads 1] [--cores 0] [--quick]``.
"""

from __future__ import annotations

from pathlib import Path

from experiments.bench.common import (
    THREAD_FLAGS,
    Sized,
    candidate_floor,
    check_above_floor,
    check_threads_and_cores,
    interleave,
    load_average,
    machine_record,
    parser,
    run_pinned,
    text_table,
    timing,
    torch_single_thread,
    write_report,
)

DIM = 61_706
CONFIGS = ((128, 4), (256, 8))  # (block size, log2 n_IS)


#: the command line: flag -> (type, default, help)
FLAGS = {
    "--quick": (bool, False, "tiny sizes, for tests"),
    "--repeats": (int, Sized(5, 1), None),
    "--samples": (int, Sized(10, 2), "n_DL samples encoded, streams decoded"),
    "--dim": (int, Sized(DIM, 4096), "mask dimension (LeNet5's by default)"),
    **THREAD_FLAGS,
    "--output": (Path, Path("results/bench/bicompfl_round.json"), None),
}


def _parse(argv):
    p = parser("experiments.bench.bicompfl_round", __doc__, FLAGS)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.samples < 1 or args.dim < 256:
        p.error(
            "--repeats and --samples must be >= 1 and --dim >= 256 (one block of the larger configuration)"
        )
    check_threads_and_cores(p, args)
    return args


def _torch_encode(torch, q, p, b, K, seeds, generator):
    """Per sample: all K x d candidates from the shared seed, block log-weights, multinomial index."""
    d = q.shape[0]
    B = -(-d // b)
    pad = B * b - d
    qp = torch.nn.functional.pad(q, (0, pad), value=0.5).view(B, b)
    pp = torch.nn.functional.pad(p, (0, pad), value=0.5).view(B, b)
    l1, l0 = torch.log(qp / pp), torch.log((1 - qp) / (1 - pp))
    out = []
    for s in seeds:  # the n_DL samples
        generator.manual_seed(int(s))
        u = torch.rand((K, B, b), generator=generator)
        x = u < pp
        logw = torch.where(x, l1, l0).sum(-1)  # [K, B]
        idx = torch.multinomial(torch.softmax(logw.T, dim=-1), 1).squeeze(-1)  # [B]
        out.append(idx)
    return out


def _torch_decode(torch, p, b, K, seeds, indices, generator):
    d = p.shape[0]
    B = -(-d // b)
    pp = torch.nn.functional.pad(p, (0, B * b - d), value=0.5).view(B, b)
    out = []
    for s, idx in zip(seeds, indices, strict=True):
        generator.manual_seed(int(s))
        u = torch.rand((K, B, b), generator=generator)  # the whole stream, to reach the chosen rows
        x = u[idx, torch.arange(B)] < pp
        out.append(x.view(-1)[:d])
    return out


def _one_config(args, torch, theta, prior, b: int, log2k: int) -> dict:
    """Times encode and decode of one (block size, n_IS) for both contestants, and the candidate floor of
    the encode (:func:`experiments.bench.common.candidate_floor`), interleaved; refuses an encode figure
    below the floor."""
    import jax
    import jax.numpy as jnp

    from sidejax.algorithms.bicompfl import decode_samples, encode_samples
    from sidejax.coding import KLMSConfig, klms_coder, klms_init
    from sidejax.coding.importance import choose_chunk_size
    from sidejax.distributions import Bernoulli
    from sidejax.keys import client_keys, downlink_keys

    n, dim = args.samples, len(theta)
    K = 2**log2k
    cfg = KLMSConfig(log2_num_candidates=log2k, adaptive=False, block_size=b)
    coder, state = klms_coder(cfg), klms_init(dim, cfg)
    q, p = Bernoulli(jnp.asarray(theta)), Bernoulli(jnp.asarray(prior))
    keys = downlink_keys(jax.random.key(0), 3)
    enc = jax.jit(lambda k, q, p: encode_samples(coder, k, q, p, state, n)[0])
    streams = [encode_samples(coder, client_keys(jax.random.key(1), i), q, p, state, 1)[0] for i in range(n)]
    shared = [client_keys(jax.random.key(1), i).shared for i in range(n)]
    cap = cfg.capacity_words(dim)
    chunk = choose_chunk_size(dim, K, cfg.memory_budget_bytes)
    floor = candidate_floor(p, K, chunk, n)

    def dec_all(msgs, p):
        return [decode_samples(coder, k, p, state, m, 1, cap)[0] for k, m in zip(shared, msgs, strict=True)]

    dec = jax.jit(dec_all)
    contestants = {
        "sidejax_encode": lambda: enc(keys, q, p),
        "sidejax_decode": lambda: dec(streams, p),
        "candidate_floor": lambda: floor(keys.shared),
    }
    if torch is not None:
        tq, tp = torch.from_numpy(theta), torch.from_numpy(prior)
        gen = torch.Generator()
        seeds = list(range(100, 100 + n))
        idx = _torch_encode(torch, tq, tp, b, K, seeds, gen)
        contestants["torch_encode"] = lambda: _torch_encode(torch, tq, tp, b, K, seeds, gen)
        contestants["torch_decode"] = lambda: _torch_decode(torch, tp, b, K, seeds, idx, gen)
    interleave(contestants, 1)  # compile and warm up
    stats = {name: timing(t) for name, t in interleave(contestants, args.repeats)[0].items()}
    med = {name: t["median_wall_s"] for name, t in stats.items()}
    cpu = {name: t["median_cpu_s"] for name, t in stats.items()}
    entry = {
        "block_size": b,
        "num_candidates": K,
        "samples": n,
        "chunk_size": chunk,
        "seconds": {name: {"median": med[name], "all": t["wall_s"]} for name, t in stats.items()},
        "timing": stats,
        "encode_over_floor_cpu_time": check_above_floor(
            f"sidejax encode (blocks of {b}, n_IS {K})", cpu["sidejax_encode"], cpu["candidate_floor"]
        ),
        "bits_per_parameter_per_sample": (-(-dim // b)) * log2k / dim,
    }
    if torch is not None:
        entry["torch_over_sidejax_time"] = {
            "encode": med["torch_encode"] / med["sidejax_encode"],
            "decode": med["torch_decode"] / med["sidejax_decode"],
        }
        entry["torch_over_sidejax_cpu_time"] = {
            "encode": cpu["torch_encode"] / cpu["sidejax_encode"],
            "decode": cpu["torch_decode"] / cpu["sidejax_decode"],
        }
    return entry


def _child(args) -> dict:
    import numpy as np

    load_before = load_average()
    try:
        import torch

        if args.threads:
            torch_single_thread(torch)
    except ImportError:  # recorded as null
        torch = None

    rng = np.random.default_rng(0)
    theta = np.clip(rng.uniform(0.01, 0.99, args.dim), 0.01, 0.99).astype(np.float32)
    prior = np.clip(theta + rng.normal(0, 0.05, args.dim), 0.01, 0.99).astype(np.float32)
    results = {}
    for b, log2k in CONFIGS:
        entry = _one_config(args, torch, theta, prior, b, log2k)
        results[f"b{b}_k{2**log2k}"] = entry
    return {
        "benchmark": "bicompfl_importance_sampling_vs_torch",
        "dim": args.dim,
        "threads": args.threads,
        "cores": args.cores,
        "repeats": args.repeats,
        "torch": None if torch is None else torch.__version__,
        "machine": machine_record(load_before=load_before, torch=torch),
        "configs": results,
    }


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    return run_pinned("experiments.bench.bicompfl_round", args, argv, lambda: _report(args, _child(args)))


def _report(args, out: dict) -> dict:
    rows = []
    for name, entry in out["configs"].items():
        for side in ("sidejax_encode", "sidejax_decode", "candidate_floor", "torch_encode", "torch_decode"):
            t = entry["timing"].get(side)
            if t is not None:
                rows.append([name, side, t["median_wall_s"], t["median_cpu_s"], t["cpu_over_wall"]])
    columns = [
        ("config", "<10"),
        ("contestant", "<16"),
        ("wall s", "9.4f"),
        ("CPU s", "9.4f"),
        ("CPU/wall", "8.2f"),
    ]
    table = "\n".join(["BICompFL importance sampling vs PyTorch (medians)", *text_table(columns, rows)])
    write_report(out, args.output, table=table, trailing_newline=False)
    return out


if __name__ == "__main__":
    main()
