"""The key schedule: the only place where sidejax derives PRNG keys.

Every random draw in a federated run is a pure function of one ``base_key`` and of *where* it happens:

.. math::

    k_t = \\mathrm{fold\\_in}(k_{\\text{base}}, t), \\qquad
    k_{t,i} = \\mathrm{fold\\_in}(k_t, i), \\qquad
    k^{\\text{shared}}_{t,i} = \\mathrm{fold\\_in}(k_{t,i}, \\texttt{SHARED}), \\quad
    k^{\\text{private}}_{t,i} = \\mathrm{fold\\_in}(k_{t,i}, \\texttt{PRIVATE})

with :math:`k_{\\text{base}}` the ``rounds_key`` of :func:`run_keys`, where ``t`` is the round index and
``i`` the *global* client id (never its slot among the participants of a round). Streams are separated by
role tags applied with ``fold_in`` rather than by ``split``, so adding a new stream never shifts an existing
one, and round ``t``'s randomness does not depend on how many rounds a run asks for or where it resumed.

- ``shared`` keys are known to the client and the server: the server regenerates candidates, dithers and
  latent scales from them. They are never sent.
- ``private`` keys are the client's alone: minibatch order, importance-sampling index choice, SGLD noise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from sidejax.types import PRNGKey

__all__ = [
    "SHARED",
    "PRIVATE",
    "SAMPLING",
    "DOWNLINK",
    "EVAL",
    "INIT",
    "ROUNDS",
    "SERVER",
    "ClientKeys",
    "run_keys",
    "canonicalize_key",
    "round_key",
    "client_keys",
    "stream_key",
]

SHARED = 0
PRIVATE = 1
SAMPLING = 2
DOWNLINK = 3
EVAL = 4
INIT = 5
ROUNDS = 6
SERVER = 7  # the server's own randomness in a round (e.g. Langevin noise), from the round key


class ClientKeys(NamedTuple):
    """The two keys of one client in one round.

    Attributes:
      shared: known to client and server (candidates, dithers); the server re-derives it from the round key
        and the client id.
      private: the client's own (minibatch order, index selection, Langevin noise).
    """

    shared: PRNGKey
    private: PRNGKey


def canonicalize_key(key_or_seed: PRNGKey | int) -> PRNGKey:
    """Returns a typed ``jax.random.key`` from an int seed, a typed key, or a legacy uint32[2] key."""
    if isinstance(key_or_seed, int):
        return jax.random.key(key_or_seed)
    if jax.dtypes.issubdtype(key_or_seed.dtype, jax.dtypes.prng_key):
        return key_or_seed
    return jax.random.wrap_key_data(key_or_seed)


def stream_key(key: PRNGKey, tag: int) -> PRNGKey:
    """Derives the named stream ``tag`` (one of the module constants) from ``key``."""
    return jax.random.fold_in(key, tag)


def run_keys(seed: int) -> tuple[PRNGKey, PRNGKey]:
    """The two top-level keys of a run with integer ``seed``: ``(init_key, rounds_key)``.

    ``init_key = fold_in(key(seed), INIT)`` initialises the model; ``rounds_key = fold_in(key(seed), ROUNDS)``
    is the ``base_key`` of :func:`sidejax.fl.run_rounds`, whose round ``t`` uses ``fold_in(rounds_key, t)``.
    """
    base = jax.random.key(seed)
    return stream_key(base, INIT), stream_key(base, ROUNDS)


def round_key(base_key: PRNGKey, round_index) -> PRNGKey:
    """Key of round ``round_index`` (a traced int is fine)."""
    return jax.random.fold_in(base_key, round_index)


def client_keys(rkey: PRNGKey, client_id) -> ClientKeys:
    """Keys of global client ``client_id`` in the round whose key is ``rkey``."""
    k = jax.random.fold_in(rkey, client_id)
    return ClientKeys(shared=jax.random.fold_in(k, SHARED), private=jax.random.fold_in(k, PRIVATE))
