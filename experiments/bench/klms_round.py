"""Benchmark: the KLMS coder's share of a FedPM-KLMS round at the ``klms_fmnist`` preset, before vs after
sizing the encoder's per-block work to the live block count.

The preset (``klms_fmnist_fedpm_klms``: LeNet5, ``dim`` = 61,706, 10 clients, K = 256, MAX_BLOCK_SIZE 1024)
is run for ``--warmup-rounds`` rounds so that the partition is a real one (a few hundred blocks). Then, from
that state, in one process and interleaved (A, B, A, B, ...; best of ``--repeats``):

- ``round``: one jitted ``round_step`` (local training of every client, KLMS encode, decode, BayesAgg);
- ``coder``: the KLMS part alone, jitted like the round: ``klms_encode`` for every client under
  ``lax.map`` (the preset's client strategy), ``klms_decode`` (vmapped) and ``klms_server_update``.

"before" is ``KLMSConfig(bucketed=False)``: the encoder's ``[blocks, K]`` log-weights and Gumbel noise are
sized to ``max_blocks = dim``; "after" is the default: the smallest static bucket
(:meth:`sidejax.coding.KLMSConfig.work_buckets`) holding the broadcast partition's block count. Both are timed
in a round that uses the broadcast partition (``update = False``, the usual round) and in an update round
(clients re-partition; "after" buckets each client's own count there too when the preset runs clients
under ``lax.map``, ``KLMSConfig(bucket_update_rounds=True)``). The run also checks that before and after
send the same messages for the same keys.

Both wall-clock and process CPU time (all threads) are recorded; on a shared machine the CPU time is the
steadier of the two. Writes JSON (default ``results/bench/klms_round.json``) and prints the coder's share of
a round and the coder speed-up.

Run: ``python -m experiments.bench.klms_round [--warmup-rounds 4] [--repeats 3]``.

Measurements: docs/benchmarks.md#on-the-2-core-cpu.
"""

from __future__ import annotations

import functools
import time

from experiments.bench.common import best, interleave, load_average, machine_record, parser, write_json

#: the command line: flag -> (type, default, help)
FLAGS = {
    "--preset": (str, "klms_fmnist_fedpm_klms", "experiment preset (FedPM-KLMS)"),
    "--warmup-rounds": (int, 4, "rounds run before timing (>= 1)"),
    "--repeats": (int, 3, "timed repetitions of each case (best kept)"),
}


def _parse_args(argv):
    p = parser("experiments.bench.klms_round", __doc__, FLAGS, out="results/bench/klms_round.json")
    args = p.parse_args(argv)
    if args.warmup_rounds < 1 or args.repeats < 1:
        p.error("--warmup-rounds and --repeats must be >= 1")
    from experiments.config import load_preset

    config = load_preset(args.preset)
    if config.algorithm != "fedpm_klms":
        p.error(f"--preset must be a fedpm_klms preset, got algorithm {config.algorithm!r}")
    return args, config


def _algorithms(config, loss_fn, per_client: bool):
    """``(cfgs, algos)``: the KLMS configurations before and after bucketing, and their FedPM-KLMS."""
    from experiments.algorithms import klms_config
    from experiments.methods import make_optimizer
    from sidejax.algorithms import fedpm
    from sidejax.coding import klms_coder
    from sidejax.fl import LocalTraining

    cfgs = {
        "before": klms_config(config, bucketed=False),
        "after": klms_config(config, bucketed=True, bucket_update_rounds=per_client),
    }
    algos = {
        name: fedpm(
            loss_fn,
            LocalTraining(
                make_optimizer(config.method.client_optimizer, config.method.client_lr),
                batch_size=config.method.batch_size,
                num_epochs=config.method.local_epochs,
                num_steps=config.method.local_steps,
            ),
            coder=klms_coder(cfg),
            estimator=config.method.estimator,
            clients_per_round=config.clients_per_round,
        )
        for name, cfg in cfgs.items()
    }
    return cfgs, algos


def _coder_fn(cfg, rkey, ids):
    """The jitted coder alone: every client's :func:`klms_encode` (``lax.map``), the decodes and the server
    update."""
    import jax

    from sidejax.coding import klms_decode, klms_encode, klms_server_update
    from sidejax.distributions import Bernoulli
    from sidejax.keys import client_keys

    def coder(kstate, theta, qs):
        p = Bernoulli(theta)

        def one(args):
            cid, q = args
            return klms_encode(client_keys(rkey, cid), Bernoulli(q), p, kstate, cfg)[0]

        messages = jax.lax.map(one, (ids, qs))
        shared = jax.vmap(lambda cid: client_keys(rkey, cid).shared)(ids)
        decode = lambda key, msg: klms_decode(key, p, kstate, msg, cfg)  # noqa: E731
        _, decoded = jax.vmap(decode)(shared, messages)
        new, info = klms_server_update(kstate, decoded, cfg)
        return messages, new, info

    return jax.jit(coder)


def _time_case(update: bool, state, fed, rkey, rounds, coders, theta, qs, repeats: int) -> dict:
    """One case (an update round or not): first calls, then the best of ``repeats`` interleaved calls of the
    round and of the coder, before and after; speed-ups and coder shares, wall and CPU."""
    import jax.numpy as jnp

    kstate = state.server.coder._replace(update=jnp.asarray(update))
    rstate = state._replace(server=state.server._replace(coder=kstate))
    names = list(rounds)
    calls = {}
    for name in names:
        calls[name, "round"] = functools.partial(rounds[name], rkey, rstate, fed)
        calls[name, "coder"] = functools.partial(coders[name], kstate, theta, qs)
    first, outputs = interleave(calls, 1)  # compile + warm up
    same = all(
        bool(jnp.all(getattr(outputs["before", "coder"][0], f) == getattr(outputs["after", "coder"][0], f)))
        for f in ("num_bits", "payload")
    )
    fastest = best(interleave(calls, repeats)[0])
    case = {"first_call_wall_seconds": {n: {k: first[n, k][0][0] for k in ("round", "coder")} for n in names}}
    for i, kind in enumerate(("wall", "cpu")):
        sec = {n: {k: fastest[n, k][i] for k in ("round", "coder")} for n in names}
        case[kind] = {
            "seconds": sec,
            "coder_share_of_round": {n: sec[n]["coder"] / sec[n]["round"] for n in names},
            "coder_speedup": sec["before"]["coder"] / sec["after"]["coder"],
            "round_speedup": sec["before"]["round"] / sec["after"]["round"],
        }
    case["same_messages_before_and_after"] = same
    return case


def _print_summary(result: dict, out) -> None:
    for kind, case in result["cases"].items():
        for clock in ("cpu", "wall"):
            c = case[clock]
            share = c["coder_share_of_round"]
            print(
                f"{kind} ({clock} time): coder share of a round "
                f"{share['before']:.1%} -> {share['after']:.1%}; "
                f"coder {c['coder_speedup']:.2f}x faster, round {c['round_speedup']:.2f}x faster"
            )
        print(f"{kind}: same messages before and after: {case['same_messages_before_and_after']}")
    print(
        f"live blocks {result['num_blocks_after_warmup']} of max_blocks {result['dim']}; "
        f"buckets {result['work_buckets']}; wrote {out}"
    )


def main(argv=None) -> dict:
    args, config = _parse_args(argv)
    load_before = load_average()
    import jax
    import jax.numpy as jnp

    from experiments.algorithms import resolve_client_strategy
    from experiments.driver import prepare
    from sidejax.fl import build_round_step, classification_loss, run_rounds
    from sidejax.keys import round_key, run_keys
    from sidejax.models import init_params

    _, spec, fed, _, _ = prepare(config)
    loss_fn = classification_loss(spec.module.apply)
    strategy = resolve_client_strategy(config)
    per_client = strategy == "map"  # update rounds bucketed too when clients run one at a time
    cfgs, algos = _algorithms(config, loss_fn, per_client)
    init_key, rounds_key = run_keys(config.run.seed)
    params = init_params(init_key, spec)
    state = algos["after"].init(init_key, params, int(fed.num_examples.shape[0]))
    t0 = time.perf_counter()
    state, infos = run_rounds(algos["after"], rounds_key, state, fed, args.warmup_rounds, client_map=strategy)
    jax.block_until_ready(state)
    warmup_s = time.perf_counter() - t0
    updates = [bool(u) for u in infos.server.coder.updated]
    dim = int(state.server.theta.shape[0])
    num_blocks = int(state.server.coder.blocks.num_blocks)
    rkey = round_key(rounds_key, state.round_index)
    C = config.clients_per_round
    ids = jnp.arange(C, dtype=jnp.int32)
    # client distributions for the coder-only timing: encode cost depends on shapes, not values
    theta = state.server.theta
    noise = 0.05 * jax.random.normal(jax.random.key(0), (C, dim))
    qs = jnp.clip(theta[None, :] + noise, 0.01, 0.99)

    rounds = {name: jax.jit(build_round_step(algo, client_map=strategy)) for name, algo in algos.items()}
    coders = {name: _coder_fn(cfg, rkey, ids) for name, cfg in cfgs.items()}
    cases = {}
    for update in (False, True):
        kind = "update_round" if update else "broadcast_partition_round"
        cases[kind] = _time_case(update, state, fed, rkey, rounds, coders, theta, qs, args.repeats)
    after_cfg = cfgs["after"]
    result = {
        "preset": args.preset,
        "dim": dim,
        "clients_per_round": C,
        "log2_num_candidates": after_cfg.log2_num_candidates,
        "max_block_size": after_cfg.max_block_size,
        "num_blocks_after_warmup": num_blocks,
        "work_buckets": list(after_cfg.work_buckets(dim)),
        "warmup_rounds": args.warmup_rounds,
        "warmup_update_rounds": updates,
        "warmup_seconds": warmup_s,
        "repeats": args.repeats,
        "machine": machine_record(load_before=load_before),
        "cases": cases,
    }
    out = write_json(result, args.out)
    _print_summary(result, out)
    return result


if __name__ == "__main__":
    main()
