"""Shared test helpers (importable from every test module: ``pythonpath = ["tests"]`` in pyproject.toml)."""

from __future__ import annotations

import gzip
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sidejax.algorithms import (
    BPCFLSettings,
    DOSFLSettings,
    FedPASettings,
    LangevinSettings,
    bicompfl_downlink,
    bicompfl_gr,
    bicompfl_gr_reconst,
    bicompfl_pr,
    bpcfl,
    cepam,
    cser,
    dosfl,
    doublesqueeze,
    fedavg,
    fedpa,
    fedpm,
    hmc_inference,
    liec,
    m3,
    memsgd,
    neolithic,
    qlsd,
    qsgd,
    sgld,
    signsgd,
)
from sidejax.algorithms.perfedavg import PerFedAvgSettings, perfedavg
from sidejax.algorithms.pfedbayes import CoresetSettings, PFedBayesSettings, coreset_pfedbayes, pfedbayes
from sidejax.algorithms.pfedme import PFedMeSettings, pfedme
from sidejax.coding.klms import KLMSConfig, klms_coder, klms_init
from sidejax.coding.lattice import additive_noise_coder, clip_update
from sidejax.coding.lrsuq import GaussianNoise
from sidejax.data import load_dataset, make_federated_data, partition
from sidejax.fl import Batch, LocalTraining, run_rounds
from sidejax.models import ModelSpec, count_params, init_params

__all__ = [
    "BASE",
    "SMALL_KLMS",
    "small_algorithm",
    "SMALL_ALGORITHMS",
    "report_each",
    "tree_equal",
    "assert_trees_close_across_programs",
    "assert_clean_run",
    "abstract_params",
    "abstract_count",
    "IDX_CODES",
    "idx_bytes",
    "write_idx",
    "fake_mnist",
    "fake_cifar_batch",
    "small_digits_federation",
    "rounds_one_by_one",
]

#: The base key of the shared FedAvg run (conftest ``fedavg_ten_rounds``) and of the engine tests.
BASE = jax.random.key(42)


def small_digits_federation(num_clients: int, num_examples: int = 240):
    """``(fed, batch)``: ``num_examples`` digits (a fixed random choice) split iid over ``num_clients``
    clients, and all of them as one batch (for the loss)."""
    train = load_dataset("digits", "train")
    keep = np.random.default_rng(0).permutation(len(train.y))[:num_examples]
    x, y = train.x[keep], train.y[keep]
    fed = make_federated_data(x, y, partition("iid", y, num_clients, seed=0))
    return fed, Batch(jnp.asarray(x), jnp.asarray(y), jnp.ones(len(y), jnp.float32))


def rounds_one_by_one(algo, params, fed, rounds: int):
    """``([state_0, ..., state_rounds], infos)``: ``rounds`` rounds of ``algo`` from ``init(key(0), params)``
    on ``fed`` with base key :data:`BASE`, one round per call (one compiled program, every state kept), the
    infos concatenated over rounds."""
    states = [algo.init(jax.random.key(0), params, int(fed.num_examples.shape[0]))]
    infos = []
    for _ in range(rounds):
        state, info = run_rounds(algo, BASE, states[-1], fed, 1, client_map="map")
        states.append(state)
        infos.append(info)
    return states, jax.tree.map(lambda *a: np.concatenate(a), *infos)


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def forced_devices_env(devices: int, **extra: str) -> dict:
    """The environment of a subprocess that needs ``devices`` CPU devices (the count must be set before JAX
    starts): this process's environment and XLA flags with the device count replaced, so a subprocess of a
    run at LLVM -O0 (``make test``, the breadth tests of ``make test-all``) compiles at -O0 too, and one of a
    run at XLA's default level at that level."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return dict(os.environ, **extra, XLA_FLAGS=" ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"]))


def tree_equal(a, b) -> bool:
    """Bit equality of two pytrees (NaNs equal; key leaves are skipped: they are compared by their data
    where it matters)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(la, lb, strict=True)
        if not jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key)
    )


def assert_trees_close_across_programs(a, b, ulps: int) -> None:
    """``a`` and ``b`` come from two differently compiled programs computing the same thing.

    XLA may fuse, vectorise and order float reductions differently in two programs (and differently on
    another CPU), so their floats agree to a few units in the last place, not bit for bit: on another
    machine of the same kind the one-step FedAvg test differed by 1-3 ULP on 9 of its 2,778 weights.
    Float leaves must agree within ``ulps`` ULPs of the leaf's largest magnitude (rounding errors are
    absolute at the scale of the sums that produce them, so an entry near zero is not held to its own, much
    finer, spacing); integer and bool leaves (client ids, step counts, flags) and key leaves must be equal.
    """
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            scale = np.spacing(np.max(np.abs(y), initial=np.finfo(y.dtype).tiny).astype(y.dtype))
            np.testing.assert_allclose(x, y, rtol=0, atol=ulps * float(scale))
        else:
            np.testing.assert_array_equal(x, y)


#: The KLMS configuration of the algorithms' integration runs (small blocks: a 25,818-parameter MLP).
SMALL_KLMS = KLMSConfig(log2_num_candidates=2, max_block_size=64)
SMALL_ALGORITHMS = (
    "fedpm",
    "fedpm_klms",
    "qsgd",
    "qsgd_klms",
    "signsgd",
    "signsgd_klms",
    "qlsd",
    "sgld_klms",
)


def cond_branch_counts(jaxpr) -> list[int]:
    """The number of branches of every ``cond`` (``lax.cond``/``lax.switch``) in ``jaxpr`` and the jaxprs
    nested in its equations, in program order: how a test sees which static buckets a program can run."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            out.append(len(eqn.params["branches"]))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if hasattr(sub, "jaxpr"):
                    out += cond_branch_counts(sub.jaxpr)
    return out


def small_algorithm(name: str, loss, clients: int):
    """One of :data:`SMALL_ALGORITHMS` on ``loss`` with ``clients`` participants per round (10 clients in
    all), its KLMS variant with :data:`SMALL_KLMS`."""
    common = dict(clients_per_round=clients)
    lang = dict(num_clients=10, clients_per_round=clients, settings=LangevinSettings(batch_size=32))
    klms = klms_coder(SMALL_KLMS)
    builders = {
        "fedpm": lambda: fedpm(loss, LocalTraining(optax.adam(0.1), batch_size=32), **common),
        "fedpm_klms": lambda: fedpm(
            loss, LocalTraining(optax.adam(0.1), batch_size=32), coder=klms, **common
        ),
        "qsgd": lambda: qsgd(loss, LocalTraining(optax.sgd(0.1), batch_size=32), server_lr=1.0, **common),
        "qsgd_klms": lambda: qsgd(
            loss, LocalTraining(optax.sgd(0.1), batch_size=32), server_lr=1.0, coder=klms, **common
        ),
        "signsgd": lambda: signsgd(
            loss, LocalTraining(optax.sgd(0.1), batch_size=32), server_lr=0.01, **common
        ),
        "signsgd_klms": lambda: signsgd(
            loss, LocalTraining(optax.sgd(0.1), batch_size=32), server_lr=0.01, coder=klms, **common
        ),
        "qlsd": lambda: qlsd(loss, **lang),
        "sgld_klms": lambda: sgld(loss, coder=klms, **lang),
    }
    return builders[name]()


def assert_clean_run(name: str, infos) -> None:
    """Every round of an integration run (stacked :class:`sidejax.fl.RoundInfo`) is finite, every stream
    real and well formed; a KLMS run starts with an update round and its server saw every stream valid."""
    assert bool(np.all(np.asarray(infos.clients.finite))), name
    assert bool(np.all(np.asarray(infos.server_finite))), name
    assert bool(np.all(np.asarray(infos.clients.valid))), name
    np.testing.assert_array_equal(infos.uplink_errors, 0, err_msg=name)
    assert np.all(np.asarray(infos.uplink_bits) > 0), name
    if name.endswith("_klms"):
        kinfo = infos.server.coder
        assert bool(np.all(np.asarray(kinfo.streams_valid))), name
        assert bool(np.asarray(kinfo.updated)[0]), name  # adaptive mode starts with an update round


def klms_uplink_bits_per_coordinate(algorithm_run, dim: int, method: str) -> dict[str, float]:
    """Runs ``method`` and ``method + "_klms"`` (the ``algorithm_run`` fixture), checks both runs are clean
    (:func:`assert_clean_run`) and that KLMS sends fewer uplink bits; returns each one's mean uplink bits per
    coordinate of the ``dim``-parameter model."""
    bpp = {}
    for name in (method, f"{method}_klms"):
        _, _, _, infos = algorithm_run(name)
        assert_clean_run(name, infos)
        bpp[name] = np.asarray(infos.uplink_bits).mean() / dim
    assert bpp[f"{method}_klms"] < bpp[method], bpp
    return bpp


def report_each(names, check) -> int:
    """The family scripts' loop (``tests/fl/sharded_family.py``, ``tests/fl/roles_family.py``):
    ``check(name)`` for every name, one JSON line each (``{"name": ..., "ok": true}`` or the error), every
    name reported even after a failure; returns the exit status (1 if any failed)."""
    import json
    import traceback

    failed = 0
    for name in names:
        try:
            check(name)
            print(json.dumps({"name": name, "ok": True}), flush=True)
        except Exception as exc:  # report every algorithm, then fail
            failed += 1
            detail = "".join(traceback.format_exception_only(exc)).strip()[-2000:]
            print(json.dumps({"name": name, "ok": False, "error": detail}), flush=True)
    return 1 if failed else 0


def assert_clients_rebuild_the_server(algo, server, dim: int, client_view) -> None:
    """A KLMS-coded downlink carries the server's state: for the server's coder state and one just after an
    update round (``update=False, changed=True``), a client whose state is ``client_view(sent, coder)``
    (what it knows of the server state ``sent``, with ``coder`` its own protocol state: the initial
    ``SMALL_KLMS`` partition of ``dim`` coordinates after an update round, for the partition is parsed from
    the stream, else the current one) receives the broadcast as exactly ``sent``, but for the protocol
    state's ``changed``, which is the flag just received (what the next downlink carries), as it will be in
    the server's state after its update."""
    initial = klms_init(dim, SMALL_KLMS).blocks
    assert int(initial.num_blocks) != int(server.coder.blocks.num_blocks)
    broadcast = jax.jit(lambda s: algo.broadcast(None, s, None)[1])
    receive = jax.jit(lambda view, message: algo.receive(None, None, view, None, message))
    after_update = server.coder._replace(update=jnp.asarray(False), changed=jnp.asarray(True))
    for coder in (server.coder, after_update):
        sent = server._replace(coder=coder)
        known = coder._replace(blocks=initial if bool(coder.changed) else coder.blocks, update=~coder.update)
        want = sent._replace(coder=coder._replace(changed=coder.update))
        assert tree_equal(receive(client_view(sent, known), broadcast(sent)), want)


def abstract_params(spec: ModelSpec):
    """A model's parameter shapes without allocating or compiling anything (``jax.eval_shape``)."""
    return jax.eval_shape(lambda k: init_params(k, spec), jax.random.key(0))


def abstract_count(spec: ModelSpec) -> int:
    return count_params(abstract_params(spec))


# ---------------------------------------------------------------------------------------------------
# tiny fake data files (the file formats of sidejax.data.idx and sidejax.data.cifar)

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int16): 0x0B, np.dtype(np.int32): 0x0C}


def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX file holding ``arr`` (uint8, int16 or int32), uncompressed."""
    code = IDX_CODES[arr.dtype]
    header = bytes([0, 0, code, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_idx(path, arr: np.ndarray, *, gz: bool) -> None:
    """Writes ``arr`` as an IDX file at ``path`` (a ``pathlib.Path``), gzip-compressed if ``gz``."""
    data = idx_bytes(arr)
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def fake_mnist(directory, prefix_img, prefix_lbl, n, num_classes, *, gz, label_offset=0):
    """``n`` random 28x28 uint8 images and labels ``i % num_classes + label_offset`` as two IDX files in
    ``directory``; returns ``(images, labels)``."""
    rng = np.random.default_rng(n)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % num_classes + label_offset).astype(np.uint8)
    suffix = ".gz" if gz else ""
    write_idx(directory / f"{prefix_img}{suffix}", images, gz=gz)
    write_idx(directory / f"{prefix_lbl}{suffix}", labels, gz=gz)
    return images, labels


def fake_cifar_batch(path, n, label_key, seed):
    """A CIFAR python batch of ``n`` random images with labels under ``label_key``; returns
    ``(data, labels)``."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = list(rng.integers(0, 10, size=n))
    with open(path, "wb") as f:
        pickle.dump({b"data": data, label_key: labels}, f)
    return data, labels


_KEYS_KLMS = klms_coder(SMALL_KLMS)
_BI_FIXED = KLMSConfig(log2_num_candidates=2, adaptive=False, block_size=64)
_BI_DOWN = bicompfl_downlink(64, 2, crc32=False)  # the same blocks, without the downlink's default CRC


def small_bpcfl_settings(**overrides) -> BPCFLSettings:
    """BPC-FL at test scale (docs/papers/bpcfl.md#a1): 3 pseudo-points of 2 classes, 6 updates of 2 pairs x 2
    noise draws, 3 expert trajectories pretrained full-batch for 20 Adam steps, chains of 10 (data) and 4
    (coreset) steps; ``overrides`` replace any field."""
    base = dict(
        num_points=3,
        num_classes=2,
        prior_precision=0.1,
        init_std=0.6,
        num_updates=6,
        step_size_inputs=1e-2,
        step_size_labels=0.0,
        pairs_per_update=2,
        num_noise=2,
        noise_std=1e-2,
        num_trajectories=3,
        pretrain_steps=20,
        pretrain_batch_size=None,
        pretrain_optimizer=optax.adam(1e-2),
        chain_optimizer=optax.adam(1e-2),
        data_chain_length=10,
        coreset_chain_length=4,
    )
    return BPCFLSettings(**{**base, **overrides})


def every_algorithm(loss, spec, *, num_clients: int = 10, clients_per_round: int = 3) -> dict:
    """Every algorithm of :mod:`sidejax.algorithms` at small settings on ``loss`` (the model ``spec``), by
    name: the five papers' methods and the baselines. Those that need every client each round (BICompFL-GR,
    DoubleSqueeze, NEOLITHIC, BPC-FL) get all ``num_clients``; the others ``clients_per_round``."""
    common = dict(clients_per_round=clients_per_round)
    local = dict(batch_size=32, num_epochs=2)
    bi = dict(num_clients=num_clients, coder=klms_coder(_BI_FIXED))  # the BICompFL variants
    lang = dict(
        num_clients=num_clients, clients_per_round=clients_per_round, settings=LangevinSettings(batch_size=32)
    )
    return {
        "fedavg": fedavg(loss, LocalTraining(optax.sgd(0.1), **local), **common),
        # FedPA past its burn-in (round 0 runs the FedPA branch): 2 local burn-in steps, 3 windows of 2 steps
        "fedpa": fedpa(
            loss,
            client_optimizer=optax.sgd(0.1, momentum=0.9),
            batch_size=32,
            settings=FedPASettings(burn_in_rounds=0, num_samples=3, local_burnin_steps=2, steps_per_sample=2),
            server_optimizer=optax.sgd(0.5, momentum=0.9),
            **common,
        ),
        "fedpm": fedpm(loss, LocalTraining(optax.adam(0.1), **local), **common),
        "fedpm_klms": fedpm(loss, LocalTraining(optax.adam(0.1), **local), coder=_KEYS_KLMS, **common),
        "qsgd": qsgd(loss, LocalTraining(optax.sgd(0.1), **local), **common),
        "qsgd_klms": qsgd(loss, LocalTraining(optax.sgd(0.1), **local), coder=_KEYS_KLMS, **common),
        "signsgd": signsgd(loss, LocalTraining(optax.sgd(0.1), **local), **common),
        "signsgd_klms": signsgd(loss, LocalTraining(optax.sgd(0.1), **local), coder=_KEYS_KLMS, **common),
        "qlsd": qlsd(loss, **lang),
        "sgld_klms": sgld(loss, coder=_KEYS_KLMS, **lang),
        # per-recipient downlink streams (RECIPIENTS) and several IS samples per message (DRAWS)
        "bicompfl_pr_splitdl": bicompfl_pr(
            loss,
            LocalTraining(optax.adam(0.1), **local),
            downlink=_BI_DOWN,
            num_uplink_samples=2,
            split_downlink=True,
            **bi,
            **common,
        ),
        # CEPAM's round (with-replacement sampling: ORDER under the step key) with the classic Gaussian
        # mechanism (its private noise: DRAWS under SAMPLE); the LRSUQ coder's per-block streams are recorded
        # separately below, on a small vector (a callback per fold_in inside the vmapped rejection loop
        # would take minutes on the model's 1,389 blocks)
        "cepam": cepam(
            loss,
            coder=clip_update(additive_noise_coder(GaussianNoise(0.1))),
            local_steps=3,
            **common,
        ),
        # CoreSet-PFedBayes: its two variational tracks (TRACKS), the initial coreset (SUBSETS), the
        # projection's posterior samples (PROJECTIONS, DRAWS), the initial posterior (POSTERIOR)
        "coreset_pfedbayes": coreset_pfedbayes(
            loss,
            coreset_size=5,
            settings=PFedBayesSettings(local_iters=2, personal_steps=2, batch_size=8, mc_samples=2),
            coreset=CoresetSettings(projection_samples=6),
            **common,
        ),
        # BPC-FL (one round, every client): shared expert initialisations (EXPERTS under the downlink key),
        # each client's minibatches (EXPERTS under TRAIN, DRAWS, ORDER), its pseudocoreset (PSEUDOCORESET:
        # init draw 0, learner draw 1 and its updates' draws), the server's HMC (SERVER, DRAWS)
        "bpcfl": bpcfl(
            loss,
            lambda key: init_params(key, spec),
            input_shape=(8, 8, 1),
            num_clients=num_clients,
            settings=small_bpcfl_settings(num_classes=10, pretrain_batch_size=8),
            inference=hmc_inference(
                step_size=1e-3, num_integration_steps=2, inverse_mass_matrix=1.0, num_burnin=1, num_samples=2
            ),
        ),
        "bicompfl_gr": bicompfl_gr(loss, LocalTraining(optax.adam(0.1), **local), **bi),
        "bicompfl_gr_reconst": bicompfl_gr_reconst(
            loss, LocalTraining(optax.adam(0.1), **local), downlink=_BI_DOWN, **bi
        ),
        "pfedbayes": pfedbayes(
            loss,
            settings=PFedBayesSettings(local_iters=2, personal_steps=2, batch_size=8, mc_samples=2),
            **common,
        ),
        # the personalized baselines: pFedMe's inner solves, Per-FedAvg (HF: three minibatches per step) and
        # its personal step on the client's data (DRAWS under TRAIN)
        "pfedme": pfedme(
            loss, settings=PFedMeSettings(inner_steps=2, local_iters=3, batch_size=16, lam=1.0), **common
        ),
        "perfedavg": perfedavg(
            loss, settings=PerFedAvgSettings(local_iters=2, batch_size=16, variant="hf"), **common
        ),
        "memsgd": memsgd(loss, LocalTraining(optax.sgd(0.1), **local), **common),
        "cser": cser(loss, LocalTraining(optax.sgd(0.1), **local), **common),
        "doublesqueeze": doublesqueeze(
            loss, LocalTraining(optax.sgd(0.1), **local), clients_per_round=num_clients
        ),
        "neolithic": neolithic(loss, LocalTraining(optax.sgd(0.1), **local), clients_per_round=num_clients),
        # DOSFL (one round, every client): 2 steps x 3 points, 2 epochs, 3 outer updates, eta learned by Adam
        "dosfl": dosfl(
            loss,
            input_shape=(8, 8, 1),
            num_clients=num_clients,
            settings=DOSFLSettings(
                2, 2, 3, 3, 10, optax.sgd(0.01, momentum=0.9), lr_optimizer=optax.adam(1e-4)
            ),
        ),
        "liec": liec(loss, LocalTraining(optax.sgd(0.1), **local), clients_per_round=num_clients, period=2),
        # the permutation and the sync coin: DRAWS under the downlink key
        "m3": m3(loss, LocalTraining(optax.sgd(0.1), **local), clients_per_round=num_clients),
    }
