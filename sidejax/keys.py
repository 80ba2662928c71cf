"""The key schedule: the only module where sidejax derives PRNG keys.

Every random draw in a federated run is a pure function of the run's seed and of *where* it happens. Keys
form a tree; each edge is one ``jax.random.fold_in`` of a **role tag** (a module constant) or of an
**index** (round, client, epoch, step, leaf, draw):

.. code-block:: text

    key(seed)
    ├─ INIT ─ init_key                 MODEL (flax init); FedPM: SIGNS ─ leaf l, SCORES, EVAL;
    │                                  pFedBayes: POSTERIOR (the initial means)
    └─ ROUNDS ─ rounds_key             the base_key of run_rounds
       └─ ROUND ─ round t
          ├─ SAMPLING                  the participants
          ├─ DOWNLINK                  the broadcast: SHARED / PRIVATE (one stream for every client),
          │  ├─ EXPERTS ─ DRAWS ─ j    BPC-FL: trajectory j's initialisation, identical on every client
          │  └─ RECIPIENTS ─ client i  a per-recipient stream (server and client i only): SHARED, PRIVATE
          ├─ SERVER                    the server's noise (QLSD)
          └─ CLIENTS ─ client i        i = global client id
             ├─ SHARED                 candidates, dithers (the server re-derives it)
             │  ├─ LAYERS              CEPAM: the latent scales U_j (counter hash at draw k, block j)
             │  └─ DITHERS             CEPAM: the dithers (counter hash at trial i, coordinate j·n + c)
             └─ PRIVATE
                ├─ SAMPLE              the message: index choice, quantisation, mask sample
                ├─ PROJECTIONS         CoreSet-PFedBayes: posterior sample s of the projection (DRAWS ─ s)
                ├─ SUBSETS             CoreSet-PFedBayes: the initial coreset / fixed random subset
                └─ TRAIN ─ EPOCHS ─ epoch e
                   │  ├─ ORDER         the epoch's example order
                   │  └─ STEPS ─ step s   passed to loss_fn (FedPM: MASK uniforms, LOSS)
                   ├─ TRACKS ─ track   pFedBayes' variational tracks, each with EPOCHS ─ 0 ─ STEPS ─
                   │                   iteration r: ORDER (the minibatch), DRAWS ─ the reparameterisation
                   │                   noise of inner step p, MC sample k (draw p·K + k)
                   ├─ EXPERTS          BPC-FL: the client's expert-trajectory minibatches (DRAWS ─ j ─ ORDER)
                   └─ PSEUDOCORESET    BPC-FL: DRAWS ─ 0 the initial pseudo-inputs, DRAWS ─ 1 the BPC-fKL
                                       learner (pairs and noise of update u: DRAWS ─ 2u, 2u + 1); DOSFL:
                                       DRAWS ─ 0 the initial distilled inputs, DRAWS ─ 1 its loss key

Two rules make a collision between two streams impossible by construction (up to a 2^-64 hash accident):

1. **Tags and indices never share a parent.** An index is folded only into the key of its family's tag
   (``round t = fold_in(fold_in(base, ROUND), t)``, ``client i = fold_in(fold_in(round, CLIENTS), i)``, ...),
   so client 2 can never equal a round's sampling key, and epoch 1 never a client's sample stream.
2. **Tag values are unique across the module**, so a tag applied to the wrong parent still cannot alias
   another stream of that parent.

``i`` is the *global* client id (never its slot among the participants of a round) and ``t`` the round
index read from the state, so round ``t``'s randomness does not depend on how many rounds a run asks for or
where it resumed (5 + 5 rounds = 10 rounds, bit for bit). Streams are separated by ``fold_in``, never by
``split``, so adding a stream never shifts an existing one.

- ``shared`` keys are known to the client and the server: the server regenerates candidates, dithers and
  latent scales from them. They are never sent.
- ``private`` keys are the client's alone: ``TRAIN`` (minibatch order, the key passed to the loss) and
  ``SAMPLE`` (importance-sampling index choice, stochastic quantisation, sampled masks, SGLD noise).

:func:`record_keys` is a debugging hook: inside it, every derivation (also inside ``jit``, ``vmap`` and
``scan``) is reported with its parent, stream name and folded value, which is how the test suite checks that
one round of every algorithm derives no key twice. Outside it, derivations trace to a bare ``fold_in``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.types import PRNGKey

__all__ = [
    "INIT",
    "ROUNDS",
    "ROUND",
    "SAMPLING",
    "DOWNLINK",
    "SERVER",
    "CLIENTS",
    "SHARED",
    "PRIVATE",
    "TRAIN",
    "SAMPLE",
    "EPOCHS",
    "ORDER",
    "STEPS",
    "MASK",
    "LOSS",
    "SIGNS",
    "SCORES",
    "EVAL",
    "DRAWS",
    "MODEL",
    "RECIPIENTS",
    "LAYERS",
    "DITHERS",
    "TRACKS",
    "POSTERIOR",
    "PROJECTIONS",
    "SUBSETS",
    "EXPERTS",
    "PSEUDOCORESET",
    "TAGS",
    "ClientKeys",
    "ClientStreams",
    "KeyRecord",
    "canonicalize_key",
    "stream_key",
    "run_keys",
    "round_key",
    "client_keys",
    "client_streams",
    "epoch_key",
    "step_key",
    "leaf_key",
    "draw_key",
    "downlink_keys",
    "LatticeKeys",
    "lattice_keys",
    "track_key",
    "record_keys",
]

# Role tags. Every value is distinct across the module (rule 2 of the module docstring).
INIT = 1  # key(seed) -> the initialisation key
ROUNDS = 2  # key(seed) -> the rounds key of a run (the base_key of run_rounds)
ROUND = 3  # base key -> the family of round keys (index: round t)
SAMPLING = 4  # round key -> participant sampling
DOWNLINK = 5  # round key -> the broadcast
SERVER = 6  # round key -> the server's own randomness (e.g. QLSD's Langevin noise)
CLIENTS = 7  # round key -> the family of client keys (index: global client id i)
SHARED = 8  # client key -> known to client and server (candidates, dithers)
PRIVATE = 9  # client key -> the client's own randomness
TRAIN = 10  # private key -> local training
SAMPLE = 11  # private key -> sampling the message (index choice, stochastic quantisation, mask sample)
EPOCHS = 12  # train key -> the family of epoch keys (index: epoch e)
ORDER = 13  # epoch key -> the epoch's example order
STEPS = 14  # epoch key -> the family of step keys (index: step s), passed to loss_fn
MASK = 15  # step key -> FedPM's mask uniforms
LOSS = 16  # step key -> the key FedPM passes on to the model's loss_fn
SIGNS = 17  # FedPM init key -> the family of frozen-sign keys (index: pytree leaf l)
SCORES = 18  # FedPM init key -> the initial mask scores
EVAL = 19  # FedPM init key -> the evaluation-mask uniforms
DRAWS = 20  # any key -> a family of independent draws (index: draw j), e.g. evaluation masks
MODEL = 21  # init key -> the model's parameters (flax folds its module-path hashes in below this tag)
RECIPIENTS = 22  # downlink key -> the family of per-recipient downlink keys (index: global client id i)
LAYERS = 23  # shared key -> the counter-hash key of CEPAM's lattice latents U_j (counters: draw k, block j)
DITHERS = 24  # shared key -> the counter-hash key of CEPAM's dithers (counters: trial i, coordinate j·n + c)
TRACKS = 25  # train key -> the family of variational training tracks (index: track; pFedBayes)
POSTERIOR = 26  # init key -> the initial variational posterior's means (pFedBayes)
PROJECTIONS = (
    27  # private key -> the posterior samples of a coreset's Monte-Carlo projection (DRAWS: sample s)
)
SUBSETS = 28  # private key -> a client's initial random coreset / fixed random subset (CoreSet-PFedBayes)
#: BPC-FL: downlink key -> the shared expert initialisations (every client); train key -> its minibatches
EXPERTS = 29
PSEUDOCORESET = 30  # train key -> BPC-FL's pseudocoreset: its initialisation (draw 0) and learner (draw 1)

#: name of every tag (what :func:`record_keys` reports for a tag derivation)
TAGS = {
    v: k
    for k, v in dict(
        INIT=INIT,
        ROUNDS=ROUNDS,
        ROUND=ROUND,
        SAMPLING=SAMPLING,
        DOWNLINK=DOWNLINK,
        SERVER=SERVER,
        CLIENTS=CLIENTS,
        SHARED=SHARED,
        PRIVATE=PRIVATE,
        TRAIN=TRAIN,
        SAMPLE=SAMPLE,
        EPOCHS=EPOCHS,
        ORDER=ORDER,
        STEPS=STEPS,
        MASK=MASK,
        LOSS=LOSS,
        SIGNS=SIGNS,
        SCORES=SCORES,
        EVAL=EVAL,
        DRAWS=DRAWS,
        MODEL=MODEL,
        RECIPIENTS=RECIPIENTS,
        LAYERS=LAYERS,
        DITHERS=DITHERS,
        TRACKS=TRACKS,
        POSTERIOR=POSTERIOR,
        PROJECTIONS=PROJECTIONS,
        SUBSETS=SUBSETS,
        EXPERTS=EXPERTS,
        PSEUDOCORESET=PSEUDOCORESET,
    ).items()
}
assert len(TAGS) == 30, "tag values must be distinct"


class ClientKeys(NamedTuple):
    """The two keys of one client in one round.

    Attributes:
      shared: known to client and server (candidates, dithers); the server re-derives it from the round key
        and the client id.
      private: the client's own (split further by :func:`client_streams`).
    """

    shared: PRNGKey
    private: PRNGKey


class ClientStreams(NamedTuple):
    """The two streams of a client's private key: ``train`` (local training) and ``sample`` (the message)."""

    train: PRNGKey
    sample: PRNGKey


class KeyRecord(NamedTuple):
    """One derivation seen by :func:`record_keys`.

    Attributes:
      name: the tag's name (``"SAMPLING"``) for a tag, the family's index name (``"client"``) for an index.
      data: the value folded in (the tag's value, or the index).
      parent: the parent key's data as bytes.
      child: the derived key's data as bytes.
    """

    name: str
    data: int
    parent: bytes
    child: bytes


_records: list[KeyRecord] | None = None


def _key_data(key) -> jax.Array:
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _record(name: str, parent, data, child) -> None:
    if _records is not None:
        _records.append(KeyRecord(name, int(data), np.asarray(parent).tobytes(), np.asarray(child).tobytes()))


def _fold(key: PRNGKey, data, name: str) -> PRNGKey:
    """The one place that calls ``jax.random.fold_in``."""
    child = jax.random.fold_in(key, data)
    if _records is not None:  # decided at trace time: no callback in programs traced outside record_keys
        jax.debug.callback(
            functools.partial(_record, name),
            _key_data(key),
            jnp.asarray(data, jnp.uint32),
            _key_data(child),
        )
    return child


def track_key(train_key: PRNGKey, track) -> PRNGKey:
    """Key of variational training track ``track`` (pFedBayes: 0 the full-data personal track, 1 the coreset
    track): ``fold_in(fold_in(train_key, TRACKS), track)``."""
    return _indexed(train_key, TRACKS, track, "track")


@contextlib.contextmanager
def record_keys() -> Iterator[list[KeyRecord]]:
    """Records every key derivation traced or run inside the ``with`` block (a debugging and test hook).

    Yields a list that fills with :class:`KeyRecord` s; on exit it waits for pending callbacks
    (``jax.effects_barrier``). Derivations inside ``jit``, ``vmap``, ``lax.map`` and ``scan`` are reported
    once per executed instance. Only programs *traced* inside the block record: a function jitted and compiled
    before the block reuses its cached, callback-free program.
    """
    global _records
    previous, _records = _records, []
    out = _records
    try:
        yield out
    finally:
        jax.effects_barrier()
        _records = previous


def canonicalize_key(key_or_seed: PRNGKey | int) -> PRNGKey:
    """Returns a typed ``jax.random.key`` from an int seed, a typed key, or a legacy uint32[2] key."""
    if isinstance(key_or_seed, int):
        return jax.random.key(key_or_seed)
    if jax.dtypes.issubdtype(key_or_seed.dtype, jax.dtypes.prng_key):
        return key_or_seed
    return jax.random.wrap_key_data(key_or_seed)


def stream_key(key: PRNGKey, tag: int) -> PRNGKey:
    """Derives the named stream ``tag`` (one of the module's role tags) from ``key``."""
    if tag not in TAGS:
        raise ValueError(f"tag must be one of the role tags of sidejax.keys {sorted(TAGS)}, got {tag!r}")
    return _fold(key, tag, TAGS[tag])


def _indexed(key: PRNGKey, family: int, index, name: str) -> PRNGKey:
    return _fold(stream_key(key, family), index, name)


def run_keys(seed: int) -> tuple[PRNGKey, PRNGKey]:
    """The two top-level keys of a run with integer ``seed``: ``(init_key, rounds_key)``.

    ``init_key = fold_in(key(seed), INIT)`` initialises the model and the algorithm's state;
    ``rounds_key = fold_in(key(seed), ROUNDS)`` is the ``base_key`` of :func:`sidejax.fl.run_rounds`.
    """
    base = jax.random.key(seed)
    return stream_key(base, INIT), stream_key(base, ROUNDS)


def round_key(base_key: PRNGKey, round_index) -> PRNGKey:
    """Key of round ``round_index`` (a traced int is fine): ``fold_in(fold_in(base_key, ROUND), t)``."""
    return _indexed(base_key, ROUND, round_index, "round")


def client_keys(rkey: PRNGKey, client_id) -> ClientKeys:
    """Keys of global client ``client_id`` in the round whose key is ``rkey``.

    ``k = fold_in(fold_in(rkey, CLIENTS), client_id)``, ``shared = fold_in(k, SHARED)``,
    ``private = fold_in(k, PRIVATE)``.
    """
    k = _indexed(rkey, CLIENTS, client_id, "client")
    return ClientKeys(shared=stream_key(k, SHARED), private=stream_key(k, PRIVATE))


def client_streams(private_key: PRNGKey) -> ClientStreams:
    """``(train, sample)``: the private key's local-training stream (``TRAIN``) and message-sampling stream
    (``SAMPLE``: index choice, stochastic quantisation, the sent mask)."""
    return ClientStreams(stream_key(private_key, TRAIN), stream_key(private_key, SAMPLE))


def epoch_key(train_key: PRNGKey, epoch) -> PRNGKey:
    """Key of local epoch ``epoch``: ``fold_in(fold_in(train_key, EPOCHS), epoch)``. Its children are
    ``ORDER`` (the epoch's example order, via :func:`stream_key`) and the step keys (:func:`step_key`)."""
    return _indexed(train_key, EPOCHS, epoch, "epoch")


def step_key(epoch_key_: PRNGKey, step) -> PRNGKey:
    """Key of step ``step`` of an epoch, ``fold_in(fold_in(epoch_key, STEPS), step)``: the key passed to the
    loss function."""
    return _indexed(epoch_key_, STEPS, step, "step")


def leaf_key(key: PRNGKey, leaf: int) -> PRNGKey:
    """Key of pytree leaf ``leaf``'s frozen signs: ``fold_in(fold_in(key, SIGNS), leaf)``."""
    return _indexed(key, SIGNS, leaf, "leaf")


def draw_key(key: PRNGKey, draw) -> PRNGKey:
    """Key of independent draw ``draw`` (e.g. one evaluation mask): ``fold_in(fold_in(key, DRAWS), draw)``."""
    return _indexed(key, DRAWS, draw, "draw")


def downlink_keys(downlink_key: PRNGKey, recipient=None) -> ClientKeys:
    """Keys of a downlink message the server encodes with importance sampling (BICompFL).

    ``shared`` (the candidates) is known to the server and the receiver(s); ``private`` (the index choice)
    is the server's own. With ``recipient=None`` it is one stream every client decodes (a broadcast,
    BICompFL-GR-Reconst): ``shared = fold_in(dkey, SHARED)``, ``private = fold_in(dkey, PRIVATE)``. With a
    global client id it is the randomness only the server and that client share (BICompFL-PR):
    ``k = fold_in(fold_in(dkey, RECIPIENTS), i)``, then ``SHARED`` / ``PRIVATE`` below ``k``. Sample ``l`` of
    a multi-sample message uses :func:`draw_key` of both.
    """
    k = downlink_key if recipient is None else _indexed(downlink_key, RECIPIENTS, recipient, "recipient")
    return ClientKeys(shared=stream_key(k, SHARED), private=stream_key(k, PRIVATE))


class LatticeKeys(NamedTuple):
    """The two shared streams of a lattice message (CEPAM, docs/papers/cepam.md#s2-9), both read through the
    counter hash (:mod:`sidejax.coding.counter`): ``layer`` gives block ``j``'s latent scale ``U_j`` from the
    uniforms at (draw ``k``, block ``j``), ``dither`` gives block ``j``'s trial-``i`` dither from the uniforms
    at (trial ``i``, coordinates ``j·n … j·n + n − 1``)."""

    layer: PRNGKey
    dither: PRNGKey


def lattice_keys(shared_key: PRNGKey) -> LatticeKeys:
    """Keys of the lattice streams of a message encoded with the shared key ``shared_key`` (client ``i``,
    round ``t``): ``layer = fold_in(shared, LAYERS)``, ``dither = fold_in(shared, DITHERS)``. Two derivations
    per message, whatever its number of blocks and trials: the blocks and trials are counters of the hash,
    not keys. The encoder and the decoder both derive them; they are never sent."""
    return LatticeKeys(layer=stream_key(shared_key, LAYERS), dither=stream_key(shared_key, DITHERS))
