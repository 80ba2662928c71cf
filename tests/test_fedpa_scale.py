"""experiments.fedpa_scale on a tiny digits federation: FedPA's deltas lie where the shrinkage puts them, and
the command prints the client means of each round after the burn-in."""

from __future__ import annotations

import numpy as np
import pytest

import experiments.fedpa_scale as scale
from experiments.bpcfl import suite_config
from sidejax.algorithms.fedpa import effective_shrinkage

TINY = {
    "data.dataset": "digits",
    "data.model": "mlp_32_16",
    "data.train_subset": 200,
    "data.num_clients": 4,
    "method.burn_in_rounds": 1,
    "method.num_samples": 4,
}


@pytest.mark.slow  # the diagnostic end to end: compiling a FedPA round and the sampler, ~26 s cold
def test_the_deltas_are_the_mean_offset_scaled_by_the_shrinkage(monkeypatch, capsys):
    """Σ̂ = ρI + (1 − ρ)Ŝ has its eigenvalues in [ρ, ρ + (1 − ρ) λ_max(Ŝ)], so per client
    ‖x − μ̂‖ / (ρ + (1 − ρ) λ_max) <= ‖Δ‖ <= ‖x − μ̂‖ / ρ, under both forms (ρ_ℓ for the FedPA paper's)."""
    config = suite_config("fmnist_cpu", "fedpa").override(TINY)
    rows = scale.update_scales(config, 1)
    assert [row["round"] for row in rows] == [2]
    row = rows[0]
    assert all(row[k].shape == (4,) for k in scale.FIELDS)
    assert np.all(0 < row["eig_min"]) and np.all(row["eig_min"] <= row["eig_max"])
    assert row["step"] > 0 and row["norm"] > 0
    settings = config.method.settings()
    for form in ("direct", "fedpa"):
        rho = effective_shrinkage(settings._replace(shrinkage_form=form))
        low = row["to_mean"] / (rho + (1 - rho) * row["eig_max"])
        np.testing.assert_array_less(low * (1 - 1e-5), row[form])
        np.testing.assert_array_less(row[form], row["to_mean"] / rho * (1 + 1e-5))
    # the command: the run's form in the header, then one line of client means per round
    monkeypatch.setattr(scale, "load_preset", lambda name: config)
    monkeypatch.setattr(scale, "update_scales", lambda config, rounds: rows * rounds)
    assert scale.main(["bpcfl_fmnist_cpu_fedpa", "--rounds", "2", "--form", "fedpa"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "shrinkage_form 'fedpa'" in lines[0] and len(lines) == 4
    assert [float(v) for v in lines[3].split("|")[1:-2]] == pytest.approx(
        [row[k].mean() for k in scale.FIELDS], rel=1e-3
    )


def test_only_fedpa_configurations_are_measured():
    with pytest.raises(ValueError, match="config must be a FedPA configuration"):
        scale.update_scales(suite_config("fmnist_cpu", "fedavg"), 1)
    with pytest.raises(ValueError, match="need num_samples >= 2 and rounds >= 1"):
        scale.update_scales(suite_config("fmnist_cpu", "fedpa").override(TINY), 0)
