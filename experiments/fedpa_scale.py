"""FedPA's update scale after the burn-in (docs/papers/bpcfl.md#dep-fedpa): per round and client, FedAvg's
update :math:`x_t - y_i` against FedPA's :math:`\\Delta_i = \\hat\\Sigma_i^{-1}(x_t - \\hat\\mu_i)` under both
shrinkage forms, and the spectrum of the sample covariance :math:`\\hat S_i` that decides between them.

Runs a FedPA configuration (a preset) through its burn-in rounds, then round by round: at the state
:math:`x_t`, each client's local run (its round keys, the preset's sampler) gives :math:`y_i` and its ℓ
samples, from which the two deltas (:func:`sidejax.algorithms.fedpa_delta` with ``shrinkage_form =
"direct"`` and ``"fedpa"``) and the nonzero eigenvalues of :math:`\\hat S_i` (those of the ``ℓ × ℓ`` Gram
matrix of the centred samples over ℓ − 1) are measured; then the configured algorithm runs the round, and
the server's step :math:`\\|x_{t+1} - x_t\\|` is recorded. Where :math:`\\hat S \\ll \\rho I`,
:math:`\\hat\\Sigma \\approx \\rho I` and :math:`\\|\\Delta_i\\| \\approx \\|x_t - \\hat\\mu_i\\| / \\rho`.
Run from the repository root::

    .venv/bin/python -m experiments.fedpa_scale bpcfl_fmnist_cpu_fedpa --rounds 6 --form direct
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from experiments.config import ExperimentConfig, load_preset
from experiments.driver import prepare
from experiments.driver_loop import start_rounds
from experiments.methods import make_optimizer
from sidejax.algorithms.fedpa import SHRINKAGE_FORMS, effective_shrinkage, fedpa_delta
from sidejax.fl import ClientData, build_sampling_trainer, classification_loss, run_rounds
from sidejax.keys import client_keys, client_streams, round_key

__all__ = ["client_scales", "update_scales", "main"]

#: per-client quantities of :func:`update_scales` (each ``[clients]``)
FIELDS = ("fedavg", "to_mean", "direct", "fedpa", "eig_max", "eig_min")


def client_scales(samples: jax.Array, x: jax.Array, y: jax.Array, settings) -> dict[str, jax.Array]:
    """One client's scales from its ℓ >= 2 samples ``[ℓ, P]``, the global model ``x`` and its final
    iterate ``y`` (flat): ``fedavg`` = :math:`\\|x - y\\|`, ``to_mean`` = :math:`\\|x - \\hat\\mu\\|`,
    ``direct`` / ``fedpa`` = :math:`\\|\\Delta\\|` under each shrinkage form of ``settings`` (a
    :class:`sidejax.algorithms.FedPASettings`), ``eig_max`` / ``eig_min`` = the largest and the smallest
    nonzero eigenvalue of :math:`\\hat S` (the unbiased sample covariance: rank ℓ − 1 for samples in general
    position)."""
    num = samples.shape[0]
    centred = samples - samples.mean(axis=0)
    eig = jnp.linalg.eigvalsh(centred @ centred.T / (num - 1))  # ascending; eig[0] ~ 0 (the centring)
    out = {"fedavg": jnp.linalg.norm(x - y), "to_mean": jnp.linalg.norm(x - samples.mean(axis=0))}
    for form in SHRINKAGE_FORMS:
        rho = effective_shrinkage(settings._replace(shrinkage_form=form))
        out[form] = jnp.linalg.norm(fedpa_delta(samples, x, rho))
    return out | {"eig_max": eig[-1], "eig_min": eig[1]}


def update_scales(config: ExperimentConfig, rounds: int) -> list[dict[str, Any]]:
    """Runs ``config`` (a FedPA configuration) through its burn-in, then ``rounds`` rounds; one row per round
    after the burn-in: ``round`` (1-based), the :data:`FIELDS` per client (numpy ``[clients]``, from the
    state before the round), ``step`` = :math:`\\|x_{t+1} - x_t\\|` and ``norm`` = :math:`\\|x_t\\|`.

    Raises:
      ValueError: if ``config`` is not FedPA with ℓ >= 2 samples, or ``rounds`` < 1.
    """
    if config.method.name != "fedpa":
        raise ValueError(f"config must be a FedPA configuration, got method {config.method.name!r}")
    settings = config.method.settings()
    if settings.num_samples < 2 or rounds < 1:
        raise ValueError(f"need num_samples >= 2 and rounds >= 1, got {settings.num_samples} and {rounds}")
    prepared = prepare(config)
    state, _, plan = start_rounds(config, prepared)
    fed = plan.fed
    train = build_sampling_trainer(
        classification_loss(prepared.spec.module.apply),
        make_optimizer(config.method.client_optimizer, config.method.client_lr),
        batch_size=config.method.batch_size,
        burnin_steps=settings.local_burnin_steps,
        steps_per_sample=settings.steps_per_sample,
        num_samples=settings.num_samples,
        average=settings.average_iterates,
    )

    @jax.jit
    def scales(params, rkey):
        x = ravel_pytree(params)[0]

        def one(client, indices, count):
            key = client_streams(client_keys(rkey, client).private).train
            final, samples, _ = train(key, params, ClientData(fed.x, fed.y, indices, count))
            return client_scales(samples, x, ravel_pytree(final)[0], settings)

        clients = jnp.arange(fed.num_examples.shape[0])
        return jax.vmap(one)(clients, fed.client_indices, fed.num_examples), jnp.linalg.norm(x)

    def advance(state, count):
        return run_rounds(plan.algorithm, plan.rounds_key, state, fed, count, client_map=plan.client_map)[0]

    state = advance(state, settings.burn_in_rounds) if settings.burn_in_rounds else state
    rows = []
    for t in range(settings.burn_in_rounds, settings.burn_in_rounds + rounds):
        per_client, norm = scales(state.server.params, round_key(plan.rounds_key, t))
        before = ravel_pytree(state.server.params)[0]
        state = advance(state, 1)
        step = jnp.linalg.norm(ravel_pytree(state.server.params)[0] - before)
        rows.append(
            {"round": t + 1, **{k: np.asarray(v) for k, v in per_client.items()}, "step": float(step)}
            | {"norm": float(norm)}
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.fedpa_scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("preset", help="a FedPA preset, e.g. bpcfl_fmnist_cpu_fedpa")
    parser.add_argument("--rounds", type=int, default=6, help="rounds after the burn-in (default 6)")
    parser.add_argument(
        "--form", choices=SHRINKAGE_FORMS, help="the run's shrinkage_form (default the preset's)"
    )
    parser.add_argument("--seed", type=int, help="run.seed (default the preset's)")
    args = parser.parse_args(argv)
    values = {"method.shrinkage_form": args.form, "run.seed": args.seed}
    config = load_preset(args.preset).override({k: v for k, v in values.items() if v is not None})
    print(
        f"{args.preset}, shrinkage_form {config.method.shrinkage_form!r}: means over the clients of |x - y| "
        "(FedAvg), |x - mu|, |Delta| (direct, fedpa), S-hat's largest and smallest nonzero eigenvalue; the "
        "server's step |x' - x| and |x|"
    )
    print("round | " + " | ".join(FIELDS) + " | step | |x|")
    for row in update_scales(config, args.rounds):
        means = " | ".join(f"{row[k].mean():.4g}" for k in FIELDS)
        print(f"{row['round']:5d} | {means} | {row['step']:.4g} | {row['norm']:.4g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
