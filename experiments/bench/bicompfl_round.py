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

Both single-threaded by default (``--threads 1``; see :mod:`experiments.bench.torch_compare`), median of
``--repeats`` runs, each contestant timed in turn within a repeat. Writes JSON (default
``results/bench/bicompfl_round.json``) with each configuration's seconds, and ``torch_over_sidejax_time``
for encode and decode (> 1: sidejax is faster). Two configurations: the CPU profile of
docs/papers/bicompfl.md#s2-3 (blocks of 128, 16 candidates) and its paper default (blocks of 256, 256
candidates); both are 1/32 bit per parameter.

Run: ``python -m experiments.bench.bicompfl_round [--repeats 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from experiments.bench.common import interleave, parser, single_thread_env

DIM = 61_706
CONFIGS = ((128, 4), (256, 8))  # (block size, log2 n_IS)


#: the command line: flag -> (type, default, help)
FLAGS = {
    "--repeats": (int, 5, None),
    "--samples": (int, 10, "n_DL samples encoded, streams decoded (default 10)"),
    "--threads": (int, 1, "1: both single-threaded; 0: library defaults"),
    "--output": (Path, Path("results/bench/bicompfl_round.json"), None),
    "--child": (bool, False, argparse.SUPPRESS),
}


def _parse(argv):
    return parser("experiments.bench.bicompfl_round", __doc__, FLAGS).parse_args(argv)


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
    """Times encode and decode of one (block size, n_IS) for both contestants."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sidejax.algorithms.bicompfl import decode_samples, encode_samples
    from sidejax.coding import KLMSConfig, klms_coder, klms_init
    from sidejax.distributions import Bernoulli
    from sidejax.keys import client_keys, downlink_keys

    n = args.samples
    K = 2**log2k
    cfg = KLMSConfig(log2_num_candidates=log2k, adaptive=False, block_size=b)
    coder, state = klms_coder(cfg), klms_init(DIM, cfg)
    q, p = Bernoulli(jnp.asarray(theta)), Bernoulli(jnp.asarray(prior))
    keys = downlink_keys(jax.random.key(0), 3)
    enc = jax.jit(lambda k, q, p: encode_samples(coder, k, q, p, state, n)[0])
    streams = [encode_samples(coder, client_keys(jax.random.key(1), i), q, p, state, 1)[0] for i in range(n)]
    shared = [client_keys(jax.random.key(1), i).shared for i in range(n)]
    cap = cfg.capacity_words(DIM)

    def dec_all(msgs, p):
        return [decode_samples(coder, k, p, state, m, 1, cap)[0] for k, m in zip(shared, msgs, strict=True)]

    dec = jax.jit(dec_all)
    jax.block_until_ready(enc(keys, q, p))
    jax.block_until_ready(dec(streams, p))
    contestants = {
        "sidejax_encode": lambda: enc(keys, q, p),
        "sidejax_decode": lambda: dec(streams, p),
    }
    if torch is not None:
        tq, tp = torch.from_numpy(theta), torch.from_numpy(prior)
        gen = torch.Generator()
        seeds = list(range(100, 100 + n))
        idx = _torch_encode(torch, tq, tp, b, K, seeds, gen)
        contestants["torch_encode"] = lambda: _torch_encode(torch, tq, tp, b, K, seeds, gen)
        contestants["torch_decode"] = lambda: _torch_decode(torch, tp, b, K, seeds, idx, gen)
    times = {name: [w for w, _ in t] for name, t in interleave(contestants, args.repeats)[0].items()}
    med = {name: float(np.median(v)) for name, v in times.items()}
    entry = {
        "block_size": b,
        "num_candidates": K,
        "samples": n,
        "seconds": {name: {"median": med[name], "all": v} for name, v in times.items()},
        "bits_per_parameter_per_sample": (-(-DIM // b)) * log2k / DIM,
    }
    if torch is not None:
        entry["torch_over_sidejax_time"] = {
            "encode": med["torch_encode"] / med["sidejax_encode"],
            "decode": med["torch_decode"] / med["sidejax_decode"],
        }
    return entry


def _child(args) -> dict:
    import jax
    import numpy as np

    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
    except ImportError:  # recorded as null
        torch = None

    rng = np.random.default_rng(0)
    theta = np.clip(rng.uniform(0.01, 0.99, DIM), 0.01, 0.99).astype(np.float32)
    prior = np.clip(theta + rng.normal(0, 0.05, DIM), 0.01, 0.99).astype(np.float32)
    results = {}
    for b, log2k in CONFIGS:
        entry = _one_config(args, torch, theta, prior, b, log2k)
        results[f"b{b}_k{2**log2k}"] = entry
    return {
        "dim": DIM,
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": None if torch is None else torch.__version__,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": platform.platform(),
        "configs": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child or "jax" not in sys.modules and (not args.threads or os.environ.get("XLA_FLAGS")):
        out = _child(args)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(out, indent=2))
        for name, entry in out["configs"].items():
            ratio = entry.get("torch_over_sidejax_time")
            secs = {k: round(v["median"], 4) for k, v in entry["seconds"].items()}
            print(f"{name}: {secs}  torch/sidejax: {ratio}")
        print(f"written: {args.output}")
        return 0
    env = single_thread_env() if args.threads else dict(os.environ)
    cmd = [sys.executable, "-m", "experiments.bench.bicompfl_round", "--child", *(argv or sys.argv[1:])]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
