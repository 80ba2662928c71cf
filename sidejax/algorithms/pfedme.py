r"""pFedMe: personalized FL with Moreau envelopes (Dinh, Tran, Nguyen, NeurIPS 2020), a baseline of
CoreSet-PFedBayes' Table 1 (docs/papers/coreset_pfedbayes.md#pfedme).

Client ``i`` with loss :math:`f_i` optimises the **Moreau envelope** of its loss around the global model
``w``; its **personal model** is the envelope's proximal point:

.. math::

    F_i(w) = \min_\theta\ f_i(\theta) + \frac{\lambda}{2}\|\theta - w\|^2, \qquad
    \hat\theta_i(w) = \operatorname{argmin}_\theta\ f_i(\theta) + \frac{\lambda}{2}\|\theta - w\|^2, \qquad
    \nabla F_i(w) = \lambda\,\big(w - \hat\theta_i(w)\big),

and the federation minimises :math:`\frac1N\sum_i F_i(w)`. Round ``t`` (the paper's Alg. 1):

- **downlink**: ``w^t`` as float32 (:func:`sidejax.algorithms.fedavg`'s kernels);
- **client** (:func:`pfedme_local_step`, ``R`` times from :math:`w_{i,0} = w^t`): draw a minibatch
  :math:`D_{i,r}` of ``b`` examples (the local epoch schedule, :func:`sidejax.fl.schedule_batches`); solve
  the proximal problem approximately by ``K`` gradient steps at the personal rate ``p``
  (:func:`pfedme_inner`),

  .. math::

      \theta \leftarrow \theta - p\,\big(\nabla f_i(\theta; D_{i,r}) + \lambda(\theta - w_{i,r})\big)
      \quad (K \text{ times}),

  then take a step on the envelope, :math:`w_{i,r+1} = w_{i,r} - \eta\lambda\,(w_{i,r} - \theta)`, i.e.
  :math:`w - \eta\,\nabla F_i(w)` with :math:`\hat\theta` replaced by the ``K``-step solution;
- **uplink**: :math:`w_{i,R}` through ``coder`` (default float32, ``32 P`` bits);
- **server**: :math:`w^{t+1} = (1-\beta)\,w^t + \beta\sum_i \frac{n_i}{\sum_j n_j} w_{i,R}` over the
  included participants (``β = 1``: FedAvg's averaging; the paper also runs ``β = 2``);
- **personal model** (``evaluation.personal``): the client's last ``θ`` of its latest round
  (``personal = "local"``: its local model :math:`w_{i,R}`, which is what pFedMe's code evaluates,
  docs/papers/coreset_pfedbayes.md#pfedme).

The inner solve starts each round at ``w^t`` and is warm-started across the ``R`` iterations (``θ`` carries
on from the previous minibatch's solution), as the pFedMe reference code does (its personalized optimizer
keeps the model it steps; docs/papers/coreset_pfedbayes.md#pfedme); the paper leaves the start open. The
inner steps are plain gradient steps, the paper's. An iteration whose minibatch holds no valid example (a
client smaller than the largest) leaves ``w`` and ``θ`` unchanged.

Settings of CoreSet-PFedBayes' Table 1 (pFedMe's own code, docs/papers/coreset_pfedbayes.md#r-baselines):
``η = 0.005``, ``p = 0.1`` (0.09-0.1), ``λ = 15``, ``K = 5``, ``R = 20``, ``b = 20``, ``β = 1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from sidejax.algorithms.fedavg import (
    FedAvgState,
    fedavg_broadcast,
    fedavg_init,
    fedavg_receive,
    fedavg_server_update,
    upload_params,
)
from sidejax.coding.base import Coder, float32_coder
from sidejax.fl.base import Algorithm, Batch, ClientData, ClientInfo, Evaluation
from sidejax.fl.local import schedule_batches
from sidejax.keys import ClientKeys, client_streams
from sidejax.types import Params, PRNGKey
from sidejax.utils import check_count, check_settings, stack_clients, tree_all_finite

__all__ = [
    "PFedMeSettings",
    "PERSONAL_MODELS",
    "PersonalClient",
    "check_pfedme_settings",
    "pfedme_inner",
    "pfedme_local_step",
    "personalized_algorithm",
    "pfedme",
]


class PFedMeSettings(NamedTuple):
    """pFedMe's local training and aggregation (defaults: pFedMe's settings of CoreSet-PFedBayes' Table 1,
    docs/papers/coreset_pfedbayes.md#r-baselines).

    Attributes:
      lam: ``λ``, the weight of the proximal term (15). ``λ → 0``: each personal model fits its own data
        alone and ``w`` stops moving; ``λ → ∞``: ``θ → w`` and the local step becomes SGD on ``f_i`` at rate
        ``η``.
      personal_lr: ``p``, the rate of the ``K`` inner gradient steps (0.1; they converge for
        ``p (L + λ) < 2``, ``L`` the loss's smoothness).
      lr: ``η``, the rate of the local step on the envelope (0.005).
      inner_steps: ``K``, gradient steps of each inner solve (5).
      local_iters: ``R``, local iterations (minibatches) per round (20).
      batch_size: ``b``, examples per minibatch (20).
      beta: ``β > 0``, the server's step: ``w ← (1-β) w + β · mean`` (1: the plain weighted mean).
      personal: the personal model evaluated: ``"prox"``, the last ``θ`` (the paper's personalized model,
        the envelope's proximal point), or ``"local"``, the local model ``w_{i,R}`` (what pFedMe's code
        evaluates as its "personalized" model: its ``persionalized_model_bar`` ends each round holding the
        local model's values).
    """

    lam: float = 15.0
    personal_lr: float = 0.1
    lr: float = 0.005
    inner_steps: int = 5
    local_iters: int = 20
    batch_size: int = 20
    beta: float = 1.0
    personal: str = "prox"


#: what ``PFedMeSettings.personal`` may name
PERSONAL_MODELS = ("prox", "local")

DEFAULT_SETTINGS = PFedMeSettings()


class PersonalClient(NamedTuple):
    """A personalized client's state: its personal model (``evaluation.personal``; the initial global model
    until the client's first round)."""

    params: Params


def check_pfedme_settings(settings: PFedMeSettings) -> PFedMeSettings:
    """``settings`` if valid, else ``ValueError`` naming the field."""
    positive, counts = ("lam", "personal_lr", "lr", "beta"), ("inner_steps", "local_iters", "batch_size")
    check_settings(settings, PFedMeSettings, positive=positive, counts=counts)
    if settings.personal not in PERSONAL_MODELS:
        raise ValueError(f"settings.personal must be one of {PERSONAL_MODELS}, got {settings.personal!r}")
    return settings


def _axpy(a, x, y):
    """``a·x + y`` leaf by leaf."""
    return jax.tree.map(lambda u, v: a * u + v, x, y)


def pfedme_inner(
    loss_fn: Callable, settings: PFedMeSettings, theta: Params, w: Params, batch: Batch, key: PRNGKey
) -> tuple[Params, jax.Array]:
    r"""The approximate proximal point: ``K`` gradient steps at rate ``p`` from ``theta`` on
    :math:`h(\theta) = f(\theta; D) + \frac{\lambda}{2}\|\theta - w\|^2` (``f = loss_fn(·, batch, key)``).

    For a quadratic ``f`` with Hessian ``A`` the error to :math:`\hat\theta(w)` contracts by
    :math:`(I - p(A + \lambda I))^K`, so the steps converge to the proximal point when
    :math:`p\,(\|A\| + \lambda) < 2`.

    Returns:
      ``(θ, mean of f over the K steps)``.
    """
    grad = jax.value_and_grad(loss_fn)

    def step(theta, _):
        loss, g = grad(theta, batch, key)
        pull = jax.tree.map(lambda t, v: settings.lam * (t - v), theta, w)
        return jax.tree.map(lambda t, a, b: t - settings.personal_lr * (a + b), theta, g, pull), loss

    theta, losses = jax.lax.scan(step, theta, None, length=settings.inner_steps)
    return theta, jnp.mean(losses)


def pfedme_local_step(
    loss_fn: Callable, settings: PFedMeSettings, w: Params, theta: Params, batch: Batch, key: PRNGKey
) -> tuple[Params, Params, jax.Array]:
    r"""One local iteration: ``θ`` from :func:`pfedme_inner` (warm-started at ``theta``), then
    :math:`w \leftarrow w - \eta\lambda\,(w - \theta)`: a gradient step on the Moreau envelope,
    :math:`\nabla F(w) = \lambda(w - \hat\theta(w))`, with the ``K``-step ``θ`` for :math:`\hat\theta(w)`.

    Returns:
      ``(w, θ, the inner steps' mean loss)``.
    """
    theta, loss = pfedme_inner(loss_fn, settings, theta, w, batch, key)
    step = settings.lr * settings.lam
    return jax.tree.map(lambda v, t: v - step * (v - t), w, theta), theta, loss


def _pfedme_train(loss_fn, settings: PFedMeSettings, key, w: Params, data: ClientData):
    """The client's ``R`` iterations from the received ``w`` (``θ`` starts there too):
    ``(w_R, personal model (θ or w_R), mean loss, finite, iterations done)``."""
    batches, keys = schedule_batches(key, data, settings.batch_size, settings.local_iters)

    def iteration(carry, inputs):
        w, theta = carry
        batch, k = inputs
        new_w, new_theta, loss = pfedme_local_step(loss_fn, settings, w, theta, batch, k)
        has_data = jnp.any(batch.mask > 0)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(has_data, a, b), new, old)
        return keep((new_w, new_theta), (w, theta)), (jnp.where(has_data, loss, 0.0), has_data)

    (w, theta), (losses, done) = jax.lax.scan(iteration, (w, w), (batches, keys))
    count = jnp.sum(done.astype(jnp.int32))
    loss = jnp.sum(losses) / jnp.maximum(count, 1).astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(losses)) & tree_all_finite((w, theta))
    return w, theta if settings.personal == "prox" else w, loss, finite, count


def _personalized_init(coder: Coder, server_optimizer, key, params: Params, num_clients: int):
    """FedAvg's server state (:func:`sidejax.algorithms.fedavg.fedavg_init`) and every client's personal
    model, the initial global model."""
    state = fedavg_init(server_optimizer, coder, key, params, num_clients)
    return state._replace(clients=stack_clients(PersonalClient(params), num_clients))


def _personalized_client(train, coder: Coder, keys: ClientKeys, server: FedAvgState, client, data):
    """``train(key, w, data) -> (w_i, personal, loss, finite, iterations)`` from the received model, then
    the local model's point mass through ``coder`` (:func:`sidejax.algorithms.fedavg.upload_params`)."""
    w, personal, loss, finite, count = train(client_streams(keys.private).train, server.params, data)
    message, cinfo = upload_params(coder, keys, server, w)
    info = ClientInfo(loss=loss, finite=finite, extra=count, valid=cinfo.valid)
    return PersonalClient(personal), message, info


def personalized_algorithm(
    train: Callable, *, clients_per_round: int, server_optimizer, coder: Coder | None
) -> Algorithm:
    """A personalized method on FedAvg's downlink and server (pFedMe, Per-FedAvg): FedAvg's ``init``,
    ``broadcast``, ``receive`` and ``server_update`` (``server_optimizer`` on the pseudo-gradient; ``None``:
    the weighted mean), and a client that runs ``train(key, w, data) -> (w_i, personal, loss, finite,
    iterations)`` from the received model, uploads ``w_i`` and keeps ``personal`` as its personal model
    (:class:`PersonalClient`, ``evaluation.personal``)."""
    coder = float32_coder() if coder is None else coder
    if not isinstance(coder, Coder):
        raise ValueError(f"coder must be a sidejax.coding.Coder, got {type(coder).__name__}")
    return Algorithm(
        init=functools.partial(_personalized_init, coder, server_optimizer),
        broadcast=functools.partial(fedavg_broadcast, coder),
        receive=functools.partial(fedavg_receive, coder),
        client_update=functools.partial(_personalized_client, train, coder),
        server_update=functools.partial(fedavg_server_update, server_optimizer, coder),
        evaluation=Evaluation(lambda state: state.server.params, personal=lambda state: state.clients.params),
        clients_per_round=check_count(clients_per_round, "clients_per_round"),
    )


def pfedme(
    loss_fn: Callable,
    *,
    clients_per_round: int,
    settings: PFedMeSettings = DEFAULT_SETTINGS,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds pFedMe (module docstring; docs/papers/coreset_pfedbayes.md#pfedme).

    The server's ``β`` step is FedAvg's server step with SGD at rate ``β`` on the pseudo-gradient
    ``w − mean`` (:func:`sidejax.algorithms.fedavg.fedavg_server_update`), which is
    ``(1 − β) w + β · mean``; ``β = 1`` takes the mean itself.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar``, the clients' ``f_i`` on a minibatch.
      clients_per_round: participants per round.
      settings: :class:`PFedMeSettings`.
      coder: the uplink coder of the local model (``q`` its point mass, ``p`` the point mass at ``w^t``);
        default :func:`sidejax.coding.float32_coder`.

    Returns:
      An :class:`sidejax.fl.Algorithm`; ``evaluation.personal`` gives every client's ``θ``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from sidejax.algorithms import pfedme
      >>> loss = lambda p, b, k: jnp.sum(b.mask * (b.x[:, 0] * p["w"] - b.y) ** 2) / b.mask.sum()
      >>> algo = pfedme(loss, clients_per_round=2)
      >>> state = algo.init(jax.random.key(0), {"w": jnp.zeros(())}, 3)
      >>> algo.evaluation.personal(state)["w"].shape
      (3,)
    """
    s = check_pfedme_settings(settings)
    server_optimizer = None if s.beta == 1 else optax.sgd(s.beta)
    return personalized_algorithm(
        functools.partial(_pfedme_train, loss_fn, s),
        clients_per_round=clients_per_round,
        server_optimizer=server_optimizer,
        coder=coder,
    )
