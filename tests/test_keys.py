"""The key schedule: every random stream has its own key, derived only in ``sidejax.keys``."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import every_algorithm

from sidejax.algorithms import (
    fedpm,
)
from sidejax.coding.lattice import clip_update, lrsuq_coder
from sidejax.coding.lrsuq import GaussianNoise
from sidejax.coding.toy import distributed_mean
from sidejax.distributions import PointMass
from sidejax.fl import LocalTraining, build_round_step
from sidejax.keys import (
    CLIENTS,
    PRIVATE,
    SHARED,
    client_keys,
    record_keys,
    round_key,
    run_keys,
)
from sidejax.lattices import integer_lattice

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_but_sidejax_keys_derives_keys():
    """``jax.random.fold_in`` / ``jax.random.split`` appear in the library and the experiment driver only
    inside ``sidejax/keys.py`` (the benchmarks in ``experiments/bench`` build synthetic inputs and are
    exempt)."""
    pattern = re.compile(r"random\.(fold_in|split)\b")
    sources = sorted((ROOT / "sidejax").rglob("*.py")) + sorted(
        p for p in (ROOT / "experiments").rglob("*.py") if "bench" not in p.relative_to(ROOT).parts
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sources
        if path != ROOT / "sidejax" / "keys.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def _agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))


def test_fedpm_frozen_signs_scores_and_eval_uniforms_are_independent():
    """FedPM's init draws the frozen signs of every leaf, the initial scores and the evaluation uniforms from
    one key. Each pair of those streams must be independent: a sign agrees with the sign of a score (or with
    ``u < 1/2``) at a coordinate with probability 1/2, so over ``n`` coordinates the agreement is within
    5 standard errors (``5 * 0.5 / sqrt(n)``) of 1/2. Compared both aligned at the front of the flat vector
    (where the same key drawing another shape would reuse the same bits) and at the leaf's own coordinates.

    Before the fix, leaf 1's signs and the scores came from the same key (agreement 0.0 at the front:
    perfectly anti-correlated), and leaf 4's signs and the evaluation uniforms too (agreement 1.0)."""
    n, num_leaves = 1000, 6
    params = [jnp.zeros((n,), jnp.float32) for _ in range(num_leaves)]  # only shapes are used
    algo = fedpm(lambda p, b, k: 0.0, LocalTraining(optax.adam(0.1), batch_size=1), clients_per_round=1)
    server = algo.init(jax.random.key(0), params, 1).server
    signs = [np.asarray(w) > 0 for w in server.weights]
    score_pos = np.asarray(server.theta) > 0.5  # theta = sigmoid(scores), clipped: same sign as the score
    eval_low = np.asarray(server.eval_uniforms) < 0.5
    bound = 5 * 0.5 / np.sqrt(n)
    checks = {}
    for i, s in enumerate(signs):
        own = slice(i * n, (i + 1) * n)
        checks[f"leaf {i} vs scores (front)"] = _agreement(s, score_pos[:n])
        checks[f"leaf {i} vs scores (own)"] = _agreement(s, score_pos[own])
        checks[f"leaf {i} vs eval uniforms (front)"] = _agreement(s, eval_low[:n])
        checks[f"leaf {i} vs eval uniforms (own)"] = _agreement(s, eval_low[own])
        for j in range(i):
            checks[f"leaf {i} vs leaf {j}"] = _agreement(s, signs[j])
    checks["scores vs eval uniforms"] = _agreement(score_pos, eval_low)
    bad = {k: v for k, v in checks.items() if abs(v - 0.5) > bound}
    assert not bad, (bound, bad)


# Streams each algorithm must have derived in its round (so the enumeration below is not vacuous).
_ROUND = {"ROUND", "round", "SAMPLING", "DOWNLINK", "CLIENTS", "client", "SHARED", "PRIVATE"}
_TRAIN = {"TRAIN", "EPOCHS", "epoch", "ORDER", "STEPS", "step"}
_EXPECTED = {
    "fedavg": _ROUND | _TRAIN,
    "fedpa": _ROUND | _TRAIN,
    "fedpm": _ROUND | _TRAIN | {"SAMPLE", "SIGNS", "leaf", "SCORES", "EVAL", "MASK", "LOSS"},
    "qsgd": _ROUND | _TRAIN | {"SAMPLE"},
    "signsgd": _ROUND | _TRAIN | {"SAMPLE"},
    "qlsd": _ROUND | _TRAIN | {"SAMPLE", "SERVER"},
    "toy": {"ROUND", "round", "CLIENTS", "client", "SHARED", "PRIVATE"},
}
for _host in ("fedpm", "qsgd", "signsgd"):
    _EXPECTED[_host + "_klms"] = _EXPECTED[_host]
_EXPECTED["sgld_klms"] = _EXPECTED["qlsd"] - {"SERVER"}
_EXPECTED["cepam"] = _ROUND | _TRAIN | {"SAMPLE", "DRAWS", "draw"}
_EXPECTED["cepam_lrsuq"] = {
    "ROUND",
    "round",
    "CLIENTS",
    "client",
    "SHARED",
    "LAYERS",
    "DITHERS",
}
_EXPECTED["coreset_pfedbayes"] = _ROUND | {
    "TRAIN",
    "TRACKS",
    "track",
    "EPOCHS",
    "epoch",
    "STEPS",
    "step",
    "ORDER",
    "DRAWS",
    "draw",
    "POSTERIOR",
    "PROJECTIONS",
    "SUBSETS",
}
_EXPECTED["bpcfl"] = _ROUND | {
    "TRAIN",
    "EXPERTS",
    "PSEUDOCORESET",
    "DRAWS",
    "draw",
    "ORDER",
    "SERVER",
}
_EXPECTED["pfedme"] = _ROUND | _TRAIN
_EXPECTED["perfedavg"] = _ROUND | _TRAIN | {"DRAWS", "draw"}
_EXPECTED["bicompfl_pr_splitdl"] = _EXPECTED["fedpm"] | {"DRAWS", "draw", "RECIPIENTS", "recipient"}
_EXPECTED["liec"] = _ROUND | _TRAIN | {"SAMPLE", "SERVER"}
_EXPECTED["m3"] = _ROUND | _TRAIN | {"SAMPLE", "DRAWS", "draw"}  # M3's permutation and sync coin


# The quickest algorithm of four key families (each round compiles once, 2-10 s from an empty compilation
# cache): local training (FedAvg), a server sampler (QLSD's SERVER stream), KLMS's importance sampling and
# block streams (SignSGD-KLMS), CEPAM's private noise (DRAWS under SAMPLE): 36 s from an empty compilation
# cache, so `make test` checks FedAvg alone and the slow tests these four and all fourteen (about 70 s).
_FAMILIES = ("fedavg", "qlsd", "signsgd_klms", "cepam")


@pytest.mark.parametrize(
    "which",
    [
        # FedAvg alone (the engine's client, sampling, downlink and server streams, where the collisions
        # were) in make test; the four families (36 s from an empty cache) and all fourteen in make test-all
        pytest.param(("fedavg",), id="fedavg"),
        pytest.param(_FAMILIES, id="four-families", marks=pytest.mark.breadth),
        pytest.param(None, id="all", marks=pytest.mark.breadth),
    ],
)
def test_every_key_of_one_round_of_every_algorithm_is_distinct(small_model, digits_fed, which):
    """Records every key derived by ``init`` and one round of each algorithm (and one run of the toy), all
    from the same run keys, and checks that no two different derivations (parent key, stream name, folded
    value) give the same key. The same derivation repeated (the server re-deriving a client's shared key, or
    two algorithms deriving the same client key) is the same stream, not a collision.

    Before the fix, client 2's key equalled the round's sampling key (``fold_in(round_key, 2)``,
    SAMPLING = 2), client 3's the downlink key and client 7's the server key, and FedAvg's second-epoch key
    ``fold_in(private, 1)`` equalled the sampling stream of the compressed methods."""
    spec, params, loss = small_model
    init_key, rounds_key = run_keys(0)
    derivations = defaultdict(set)
    names_by_algorithm = {}
    algorithms = every_algorithm(loss, spec, num_clients=10, clients_per_round=3)
    algorithms = {name: algorithms[name] for name in _EXPECTED if name in algorithms}
    if which is not None:
        algorithms = {name: algorithms[name] for name in which}
    for name, algo in algorithms.items():
        with record_keys() as records:
            state = algo.init(init_key, params, 10)
            jax.jit(build_round_step(algo, client_map="map"))(round_key(rounds_key, 0), state, digits_fed)
        assert records, name
        names_by_algorithm[name] = {r.name for r in records}
        for r in records:
            derivations[r.child].add((r.parent, r.name, r.data))
    with record_keys() as records:
        distributed_mean(rounds_key, jnp.array([0.5, -0.2, 1.0]), 2, 2)
    names_by_algorithm["toy"] = {r.name for r in records}
    for r in records:
        derivations[r.child].add((r.parent, r.name, r.data))
    # CEPAM's LRSUQ uplink of clients 0..2 in round 0 (11 coordinates: 6 blocks of Z^2, the last padded):
    # the latent (LAYERS) and dither (DITHERS) streams of the message, read by the counter hash at (draw,
    # block) and (trial, coordinate): no key per block or trial; encode and decode
    lrsuq = clip_update(lrsuq_coder(integer_lattice(2), GaussianNoise(0.1)))
    x = jnp.linspace(-1.0, 1.0, 11)
    with record_keys() as records:
        for client in range(3):
            keys = client_keys(round_key(rounds_key, 0), client)
            message, _ = jax.jit(lrsuq.encode)(keys, PointMass(x), PointMass(jnp.zeros(11)), ())
            jax.jit(lrsuq.decode)(keys.shared, PointMass(jnp.zeros(11)), (), message)
    names_by_algorithm["cepam_lrsuq"] = {r.name for r in records}
    for r in records:
        derivations[r.child].add((r.parent, r.name, r.data))

    assert set(names_by_algorithm) == set(algorithms) | {"toy", "cepam_lrsuq"}
    for name, names in names_by_algorithm.items():
        assert _EXPECTED[name] <= names, (name, _EXPECTED[name] - names)
    collisions = {
        child.hex(): sorted((n, d) for _, n, d in ways)
        for child, ways in derivations.items()
        if len(ways) > 1
    }
    assert not collisions, collisions
    roots = {p for ways in derivations.values() for p, _, _ in ways} - set(derivations)
    assert roots and not roots & set(derivations)
    # epochs x steps x clients x algorithms: really enumerated (CEPAM adds two per message: since the
    # counter hash its blocks and trials are counters, not keys)
    assert len(derivations) > 60


def test_recording_is_off_by_default_and_costs_nothing_outside_the_context():
    with record_keys() as records:
        round_key(jax.random.key(0), 3)
    assert [(r.name, r.data) for r in records] == [("ROUND", records[0].data), ("round", 3)]
    outside = jax.make_jaxpr(lambda k: jax.random.key_data(round_key(k, 3)))(jax.random.key(0))
    assert "callback" not in str(outside)


def test_client_keys_follow_global_id_and_streams_differ():
    rk = round_key(jax.random.key(0), 7)
    k3 = client_keys(rk, 3)
    batch = jax.vmap(client_keys, (None, 0))(rk, jnp.array([9, 3, 1]))
    assert np.array_equal(jax.random.key_data(batch.shared[1]), jax.random.key_data(k3.shared))
    assert not np.array_equal(jax.random.key_data(k3.shared), jax.random.key_data(k3.private))
    base = jax.random.fold_in(jax.random.fold_in(rk, CLIENTS), 3)  # the documented schedule
    assert np.array_equal(
        jax.random.key_data(k3.shared), jax.random.key_data(jax.random.fold_in(base, SHARED))
    )
    assert np.array_equal(
        jax.random.key_data(k3.private), jax.random.key_data(jax.random.fold_in(base, PRIVATE))
    )
    init_key, rounds_key = run_keys(0)
    assert not np.array_equal(jax.random.key_data(init_key), jax.random.key_data(rounds_key))
