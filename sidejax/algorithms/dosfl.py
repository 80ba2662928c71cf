r"""DOSFL, distilled one-shot federated learning (Zhou, Pu, Ma, Li, Wu 2020): BPC-FL's baseline on the
synthetic tasks (docs/papers/bpcfl.md#a7, docs/papers/bpcfl.md#dosfl), on the round engine.

One round (the only one):

1. **Downlink.** Nothing is sent (0 bits): the initialisation :math:`\theta_0` comes from the shared seed,
   so every party holds it (the server state's ``init``, which ``receive`` reads).
2. **Clients** (all of them). Client ``m`` distils its data into ``S`` steps of ``B`` points,
   :math:`(\tilde x_i, \tilde y_i)_{i<S}`, and one step size :math:`\tilde\eta`, by unrolled dataset
   distillation. The inner loop runs ``E`` epochs over the ``S`` steps from :math:`\theta_0`,

   .. math:: \theta_{j+1} = \theta_j - \tilde\eta\, \nabla_\theta \ell(\tilde x_{j \bmod S},
      \tilde y_{j \bmod S}; \theta_j), \qquad j = 0, \dots, ES - 1,

   (:func:`replay`, a ``lax.scan``; ``ℓ`` the loss contract's mean NLL of the ``B`` points, no prior), and
   the outer loop takes ``num_updates`` optimiser steps on the client's real loss at the end,
   :math:`L(\tilde x, \tilde y, \tilde\eta) = \ell(X_m, Y_m; \theta_{ES})`, differentiating through the
   unroll (:func:`distillation_loss`, :func:`distill`; ``jax.value_and_grad`` of the scan). The inputs
   always learn; the labels (regression only: classification labels are hard and stay fixed) and
   :math:`\tilde\eta` learn when their optimiser is given (Table 4, docs/papers/bpcfl.md#table-4: SGD with
   momentum 0.9 on :math:`\tilde x, \tilde y`, SGD or Adam on :math:`\tilde\eta`). The client uploads
   ``[x̃, ỹ, η̃]`` once through the coder (float32 by default: ``S·B·(D + 1) + 1`` floats, the paper's
   accounting with ``d_y = 1``, docs/papers/bpcfl.md#a8, read from the stream's length).
3. **Server.** It decodes the uploads and replays them **in sequence**, in client-id order: client 1's
   ``E`` epochs of ``S`` steps from :math:`\theta_0`, then client 2's from where client 1's ended, and so on
   (our reading of the DOSFL paper's server, which trains one global model on the clients' distilled data;
   the spec is silent [A], docs/papers/bpcfl.md#dosfl). The result is the global model
   (``evaluation.params``). An excluded client (:func:`sidejax.coding.included`) is skipped; with none
   included the state is kept.

Choices the spec leaves open ([A], docs/papers/bpcfl.md#dosfl): the distilled inputs start at
:math:`\mathcal N(\bar X_m, \sigma^2 I)` and the labels by frequency (classification) or at ``mean(y)``
(regression), BPC-FL's initialisation (docs/papers/bpcfl.md#a3); the real batch of the outer loss is the
client's whole data (masked), the same every update; the number of outer updates is a setting
(``num_updates``); random masking and soft resets are not built (the paper says they did not help).

The first client's replay is its own unroll from :math:`\theta_0`: the :math:`\theta_{ES}` its distilled
data was optimised for (``tests/algorithms/test_dosfl.py``). With several, the data of client
``m > 1`` is replayed from a model it was not distilled for, which is where DOSFL's one-shot model loses
(docs/papers/bpcfl.md#dosfl measures it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from sidejax.bayes.pseudocoresets import init_pseudocoreset
from sidejax.coding.base import Coder, EmptyState, Message, empty_message, float32_coder, included
from sidejax.distributions import PointMass
from sidejax.fl import Algorithm, Batch, ClientData, ClientInfo, Evaluation, RoundState
from sidejax.fl.base import initial_round_state
from sidejax.keys import PSEUDOCORESET, SERVER, ClientKeys, client_streams, draw_key, stream_key
from sidejax.types import Params
from sidejax.utils import check_count, check_number, check_positive, keep_unless_none, tree_all_finite

__all__ = [
    "DOSFLSettings",
    "Distilled",
    "DOSFLServer",
    "DOSFLClientInfo",
    "DOSFLServerInfo",
    "check_dosfl_settings",
    "distilled_floats",
    "pack_distilled",
    "unpack_distilled",
    "replay",
    "distillation_loss",
    "distill",
    "dosfl_init",
    "dosfl_broadcast",
    "dosfl_receive",
    "dosfl_client_update",
    "dosfl_server_update",
    "dosfl_metrics",
    "dosfl",
]


class DOSFLSettings(NamedTuple):
    """DOSFL's client hyperparameters (docs/papers/bpcfl.md#table-4).

    Attributes:
      num_steps: ``S``, distillation steps (one distilled batch each).
      num_epochs: ``E``, passes of the inner loop over the ``S`` steps.
      batch_size: ``B``, distilled points per step.
      num_updates: outer optimiser steps (not in Table 4 [A]).
      num_classes: ``C`` (classification: hard labels, fixed) or ``None`` (regression: float labels).
      input_optimizer: the Optax optimiser of the distilled inputs (Table 4: SGD, momentum 0.9).
      label_optimizer: the optimiser of the labels (regression only), or ``None``: labels fixed (a step
        size of 0 in Table 4).
      lr_optimizer: the optimiser of ``η̃``, or ``None``: ``η̃`` fixed at ``init_lr``.
      init_lr: ``η̃``'s initial value (0.01).
      init_std: ``σ`` of the initial inputs around the client's mean input [A].
    """

    num_steps: int
    num_epochs: int
    batch_size: int
    num_updates: int
    num_classes: int | None
    input_optimizer: optax.GradientTransformation
    label_optimizer: optax.GradientTransformation | None = None
    lr_optimizer: optax.GradientTransformation | None = None
    init_lr: float = 0.01
    init_std: float = 1.0


class Distilled(NamedTuple):
    """One client's distilled data: ``inputs [S, B, *input_shape]``, ``labels [S, B]`` (int32 for
    classification, float32 for regression) and the step size ``lr`` (scalar)."""

    inputs: jax.Array
    labels: jax.Array
    lr: jax.Array


class DOSFLServer(NamedTuple):
    """The server state: ``init`` (``θ_0``, known to every party from the shared seed), ``params`` (the
    global model: ``θ_0`` before the round) and the decoded ``distilled`` data of every client (leading
    ``[M]`` axis, client-id order; zeros before the round and for an excluded client)."""

    init: Params
    params: Params
    distilled: Distilled


class DOSFLClientInfo(NamedTuple):
    """Per client: the real loss at the end of the unroll before the first update and for the uploaded
    data, and the uploaded ``η̃``."""

    loss_first: jax.Array
    loss_last: jax.Array
    lr: jax.Array


class DOSFLServerInfo(NamedTuple):
    """The global norm of the replay's change, ``‖θ − θ_0‖``."""

    update_norm: jax.Array


def _is_optimizer(value) -> bool:
    return isinstance(value, optax.GradientTransformation)


def check_dosfl_settings(settings: DOSFLSettings) -> DOSFLSettings:
    """``settings`` if valid; else ``ValueError`` naming the field (``settings.<field>``)."""
    if not isinstance(settings, DOSFLSettings):
        raise ValueError(f"settings must be a DOSFLSettings, got {type(settings).__name__}")
    for name in ("num_steps", "num_epochs", "batch_size", "num_updates"):
        check_count(getattr(settings, name), f"settings.{name}")
    c = settings.num_classes
    if c is not None:
        check_count(c, "settings.num_classes", 2)
    if not _is_optimizer(settings.input_optimizer):
        raise ValueError(
            "settings.input_optimizer must be an optax.GradientTransformation, got "
            f"{settings.input_optimizer!r}"
        )
    for name in ("label_optimizer", "lr_optimizer"):
        value = getattr(settings, name)
        if value is not None and not _is_optimizer(value):
            raise ValueError(
                f"settings.{name} must be an optax.GradientTransformation or None, got {value!r}"
            )
    if c is not None and settings.label_optimizer is not None:
        raise ValueError(
            "settings.label_optimizer must be None for classification (num_classes given): the labels are "
            "hard class ids, fixed (Table 4's y step 0)"
        )
    check_number(settings.init_lr, "settings.init_lr", "a finite number", math.isfinite)
    check_positive(settings.init_std, "settings.init_std")
    return settings


def distilled_floats(settings: DOSFLSettings, input_shape) -> int:
    """The upload's length in values, ``S·B·(D + 1) + 1`` (docs/papers/bpcfl.md#a8 with ``d_y = 1``): the
    float32 coder sends 32 bits each."""
    d = math.prod(input_shape)
    return settings.num_steps * settings.batch_size * (d + 1) + 1


def pack_distilled(distilled: Distilled) -> jax.Array:
    """The coder's ``q`` vector ``[inputs.ravel(), labels.ravel(), lr]`` (float32)."""
    return jnp.concatenate(
        [
            jnp.ravel(distilled.inputs).astype(jnp.float32),
            jnp.ravel(distilled.labels).astype(jnp.float32),
            jnp.reshape(distilled.lr, (1,)).astype(jnp.float32),
        ]
    )


def unpack_distilled(values: jax.Array, settings: DOSFLSettings, input_shape) -> Distilled:
    """Inverse of :func:`pack_distilled` (int32 labels for classification)."""
    s, b = settings.num_steps, settings.batch_size
    n = s * b * math.prod(input_shape)
    inputs = values[:n].reshape(s, b, *input_shape)
    labels = values[n : n + s * b].reshape(s, b)
    if settings.num_classes is not None:
        labels = jnp.round(labels).astype(jnp.int32)
    return Distilled(inputs, labels, values[n + s * b])


def replay(loss_fn: Callable, params: Params, distilled: Distilled, num_epochs: int, key) -> Params:
    r"""The inner loop: ``num_epochs`` passes of :math:`\theta \leftarrow \theta - \tilde\eta \nabla_\theta
    \ell(\tilde x_i, \tilde y_i; \theta)` over the distilled steps ``i``, from ``params`` (``loss_fn(params,
    Batch, key)``, every point weighing 1). Differentiable in ``distilled`` (the outer loop's gradient flows
    through it)."""

    def step(theta, batch):
        x, y = batch
        grads = jax.grad(loss_fn)(theta, Batch(x, y, jnp.ones(x.shape[:1], x.dtype)), key)
        return jax.tree.map(lambda t, g: t - distilled.lr * g, theta, grads), None

    def epoch(theta, _):
        return jax.lax.scan(step, theta, (distilled.inputs, distilled.labels))[0], None

    return jax.lax.scan(epoch, params, None, length=num_epochs)[0]


def distillation_loss(
    loss_fn: Callable, params: Params, distilled: Distilled, real: Batch, num_epochs: int, key
) -> jax.Array:
    """The outer objective: the real batch's loss at the end of :func:`replay` from ``params``."""
    return loss_fn(replay(loss_fn, params, distilled, num_epochs, key), real, key)


def distill(
    loss_fn: Callable, settings: DOSFLSettings, params: Params, distilled: Distilled, real: Batch, key
) -> tuple[Distilled, jax.Array, jax.Array]:
    """``settings.num_updates`` outer steps from ``distilled`` (a ``lax.scan``): the gradient of
    :func:`distillation_loss` through the unroll, one optimiser per learned part (the inputs always; the
    labels and ``η̃`` when their optimiser is given).

    Returns:
      ``(distilled, losses [num_updates], final_loss)``: the learned data, the objective before each update,
      and the objective of the returned data.
    """
    s = settings
    optimizers = (s.input_optimizer, s.label_optimizer, s.lr_optimizer)
    learned = tuple(i for i, opt in enumerate(optimizers) if opt is not None)

    def objective(values, fixed):
        parts = list(fixed)
        for i, v in zip(learned, values, strict=True):
            parts[i] = v
        return distillation_loss(loss_fn, params, Distilled(*parts), real, s.num_epochs, key)

    def update(carry, _):
        values, states = carry
        loss, grads = jax.value_and_grad(objective)(values, distilled)
        new_values, new_states = [], []
        for i, v, g, st in zip(learned, values, grads, states, strict=True):
            step, st = optimizers[i].update(g, st, v)
            new_values.append(optax.apply_updates(v, step))
            new_states.append(st)
        return (tuple(new_values), tuple(new_states)), loss

    values = tuple(distilled[i] for i in learned)
    states = tuple(optimizers[i].init(v) for i, v in zip(learned, values, strict=True))
    (values, _), losses = jax.lax.scan(update, (values, states), None, length=s.num_updates)
    parts = list(distilled)
    for i, v in zip(learned, values, strict=True):
        parts[i] = v
    out = Distilled(*parts)
    return out, losses, objective(values, distilled)


def dosfl_init(
    settings: DOSFLSettings, input_shape, clients_per_round, key, params, num_clients
) -> RoundState:
    """The server state before the round: ``init = params = θ_0``, zero distilled data.

    Raises:
      ValueError: ``clients_per_round != num_clients`` (one-shot: every client uploads once).
    """
    if clients_per_round != num_clients:
        raise ValueError(
            f"DOSFL is one-shot: every client uploads its distilled data in the one round, so "
            f"clients_per_round ({clients_per_round}) must equal num_clients ({num_clients})"
        )
    del key
    s = settings
    label_dtype = jnp.float32 if s.num_classes is None else jnp.int32
    empty = Distilled(
        jnp.zeros((num_clients, s.num_steps, s.batch_size, *input_shape), jnp.float32),
        jnp.zeros((num_clients, s.num_steps, s.batch_size), label_dtype),
        jnp.zeros((num_clients,), jnp.float32),
    )
    return initial_round_state(DOSFLServer(params, params, empty), EmptyState(), num_clients)


def dosfl_broadcast(key, server: DOSFLServer, client_ids) -> tuple[DOSFLServer, Message]:
    """Nothing is sent (docs/papers/bpcfl.md#a8: ``θ_0`` comes from the shared seed)."""
    del key, client_ids
    return server, empty_message()


def dosfl_receive(dkey, keys, server: DOSFLServer, cstate, message) -> Params:
    """``θ_0``, which every party holds (the shared seed's initialisation)."""
    del dkey, keys, cstate, message
    return server.init


def dosfl_client_update(
    loss_fn: Callable,
    settings: DOSFLSettings,
    coder: Coder,
    keys: ClientKeys,
    received: Params,
    state,
    data: ClientData,
):
    """Client ``m``: initialise the distilled data (module docstring), :func:`distill` it against the
    client's whole data at the end of the unroll from ``θ_0`` (``received``), upload ``[x̃, ỹ, η̃]``. Keys:
    the train stream's ``PSEUDOCORESET`` draw 0 initialises, draw 1 is handed to ``loss_fn``."""
    s = settings
    max_examples = data.indices.shape[0]
    x = data.x[data.indices].astype(jnp.float32)
    y = data.y[data.indices]
    valid = jnp.arange(max_examples) < data.num_examples
    base = stream_key(client_streams(keys.private).train, PSEUDOCORESET)
    points = s.num_steps * s.batch_size
    init = init_pseudocoreset(
        draw_key(base, 0), x, y, valid, points, init_std=s.init_std, num_classes=s.num_classes
    )
    start = Distilled(
        init.inputs.reshape(s.num_steps, s.batch_size, *x.shape[1:]),
        init.labels.reshape(s.num_steps, s.batch_size),
        jnp.asarray(s.init_lr, jnp.float32),
    )
    real = Batch(x, y, valid.astype(jnp.float32))
    distilled, losses, final = distill(loss_fn, s, received, start, real, draw_key(base, 1))
    q = PointMass(pack_distilled(distilled))
    message, cinfo = coder.encode(keys, q, PointMass(jnp.zeros_like(q.value)), coder.init(q.value.shape[0]))
    finite = tree_all_finite(distilled) & jnp.isfinite(final)
    extra = DOSFLClientInfo(losses[0], final, distilled.lr)
    return state, message, ClientInfo(final, finite, extra, cinfo.valid)


def dosfl_server_update(
    loss_fn: Callable,
    settings: DOSFLSettings,
    coder: Coder,
    input_shape,
    round_key,
    server: DOSFLServer,
    client_ids,
    shared_keys,
    messages: Message,
    weights,
):
    """Decode every upload and replay the included ones in sequence, in client-id order, from ``θ_0``
    (module docstring): one ``lax.scan`` over the participants, an excluded one (zeroed) leaving the model
    as it is; with none included the state is kept. ``stream_key(round_key, SERVER)`` is handed to
    ``loss_fn``."""
    del weights  # the replay is the method's aggregation: every included client's steps, once
    dim = distilled_floats(settings, input_shape)
    p = PointMass(jnp.zeros((dim,), jnp.float32))
    values, decoded = jax.vmap(coder.decode, (0, None, None, 0))(shared_keys, p, coder.init(dim), messages)
    include = included(messages, decoded.valid)
    values = jnp.where(include[:, None], values, 0.0)  # an excluded stream's values never reach the model
    order = jnp.argsort(client_ids)
    distilled = jax.vmap(lambda v: unpack_distilled(v, settings, input_shape))(values[order])
    include = include[order]
    key = stream_key(round_key, SERVER)

    def one(theta, item):
        d, use = item
        new = replay(loss_fn, theta, d, settings.num_epochs, key)
        return jax.tree.map(lambda a, b: jnp.where(use, a, b), new, theta), None

    params = jax.lax.scan(one, server.init, (distilled, include))[0]
    new = keep_unless_none(include, DOSFLServer(server.init, params, distilled), server)
    change = ravel_pytree(new.params)[0] - ravel_pytree(server.init)[0]
    return new, DOSFLServerInfo(jnp.linalg.norm(change)), decoded.errors


def dosfl_metrics(info) -> dict:
    """The mean over clients of the real loss before the first update and for the uploaded data, and of
    the uploaded ``η̃``."""
    extra = info.clients.extra
    return {
        "distill_loss_first": jnp.mean(extra.loss_first, axis=-1),
        "distill_loss_last": jnp.mean(extra.loss_last, axis=-1),
        "distilled_lr": jnp.mean(extra.lr, axis=-1),
    }


def dosfl(
    loss_fn: Callable,
    *,
    input_shape: tuple[int, ...],
    num_clients: int,
    settings: DOSFLSettings,
    coder: Coder | None = None,
) -> Algorithm:
    """DOSFL (module docstring) as an :class:`sidejax.fl.Algorithm`: run it for **one** round with every
    client participating (``clients_per_round = num_clients``); ``θ_0`` is the ``params`` given to
    ``init`` (the shared initialisation); ``eval_params`` gives the replayed global model.

    Args:
      loss_fn: ``loss_fn(params, Batch, key)``, the masked mean NLL (``sidejax.fl.classification_loss``,
        or a Gaussian NLL for regression).
      input_shape: one example's input shape (the receiver knows the shapes).
      num_clients: ``M``.
      settings: :class:`DOSFLSettings`.
      coder: the uplink coder of ``[x̃, ỹ, η̃]`` (default :func:`sidejax.coding.float32_coder`).

    Raises:
      ValueError: bad settings (naming the field), ``num_clients < 1``, a bad ``input_shape``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from sidejax.algorithms import DOSFLSettings, dosfl
      >>> loss = lambda p, b, k: jnp.sum(b.mask * (b.x[:, 0] * p["w"] - b.y) ** 2) / b.mask.sum()
      >>> settings = DOSFLSettings(2, 1, 3, 5, None, optax.sgd(0.1, momentum=0.9))
      >>> algo = dosfl(loss, input_shape=(1,), num_clients=2, settings=settings)
      >>> algo.init(jax.random.key(0), {"w": jnp.zeros(())}, 2).server.distilled.inputs.shape
      (2, 2, 3, 1)
    """
    settings = check_dosfl_settings(settings)
    num_clients = check_count(num_clients, "num_clients", 1)
    try:
        input_shape = tuple(check_count(d, "input_shape", 1) for d in input_shape)
    except TypeError:
        raise ValueError(f"input_shape must be a tuple of integers >= 1, got {input_shape!r}") from None
    if not input_shape:
        raise ValueError("input_shape must be a tuple of integers >= 1, got ()")
    coder = float32_coder() if coder is None else coder
    if not isinstance(coder, Coder):
        raise ValueError(f"coder must be a sidejax.coding.Coder, got {type(coder).__name__}")
    return Algorithm(
        init=functools.partial(dosfl_init, settings, input_shape, num_clients),
        broadcast=dosfl_broadcast,
        receive=dosfl_receive,
        client_update=functools.partial(dosfl_client_update, loss_fn, settings, coder),
        server_update=functools.partial(dosfl_server_update, loss_fn, settings, coder, input_shape),
        evaluation=Evaluation(lambda state: state.server.params),
        clients_per_round=num_clients,
        metrics=dosfl_metrics,
    )
