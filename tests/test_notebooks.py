"""Every notebook in notebooks/ runs top to bottom (small settings, no downloads), and is committed with its
outputs (refreshed by ``python -m experiments.refresh_notebooks``)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from experiments.refresh_notebooks import execute_notebook, notebook_errors

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

# Smaller sizes, run right after each notebook's `parameters` cell: enough to execute every cell and check the
# notebooks' own assertions (coder law within 5 standard errors, KLMS far below FedPM's bits, accuracy
# rising), not to reproduce the committed figures. 02_klms: one K per regime for the coder law, the toy's
# smallest and largest K and N, a few protocol and federated rounds. 03_bicompfl: the coder law at two n_IS,
# two block sizes at two n_IS, two federated rounds of each of the six methods (most of its time is
# compiling their round programs). 04_cepam: smaller messages, two of the error laws,
# two lattices' rates, three rounds at one noise level and without noise. 05_coreset_pfedbayes: a smaller
# regression with two coreset sizes and one seed, two federated rounds of two minibatches per method.
# 06_bpcfl: a few BPC-fKL updates of short chains from 3 trajectories, 3 HMC samples, 3 FedAvg rounds.
TEST_PARAMETERS = {
    "01_quickstart.ipynb": "ROUNDS = 5",  # label shards, 50% participation: round 3 dips below round 1
    "02_klms.ipynb": "\n".join(
        [
            "N_COORDS = 4_000",
            "LOG2_KS = (0, 2, 6)",
            "TOY_LOG2_KS = (1, 10)",
            "TOY_CLIENTS = (1, 8)",
            "TOY_RUNS = 50",
            "THM_TRIALS = 500",
            "PROTOCOL_ROUNDS = 4",
            "FL_ROUNDS = 3",
        ]
    ),
    "04_cepam.ipynb": "\n".join(
        [
            "N_COORDS = 12_000",
            'ERROR_CASES = ("Z^2 Gauss", "Z^1 Laplace")',
            'RATE_LATTICES = ("Z^1", "E8")',
            "FL_ROUNDS = 3",
            "FL_LEVELS = (0.0, 0.1)",
        ]
    ),
    "05_coreset_pfedbayes.ipynb": "\n".join(
        [
            "N_POINTS = 300",
            "K_VALUES = (10, 40)",
            "SEEDS = 1",
            "MAP_KS = (40,)",
            "FL_ROUNDS = 2",
            "FL_LOCAL_ITERS = 2",
        ]
    ),
    "06_bpcfl.ipynb": "\n".join(
        [
            "NUM_UPDATES = 5",
            "NUM_TRAJECTORIES = 3",
            "PAIRS = 2",
            "CHAIN = 5",
            "DATA_CHAIN = 10",
            "PRETRAIN = 20",
            "NOISE_DRAWS = 2",
            "HMC_BURNIN, HMC_SAMPLES = 2, 3",
            "FEDAVG_ROUNDS = 3",
            "GAUSS_SAMPLES = 2_000",
        ]
    ),
    "03_bicompfl.ipynb": "\n".join(
        [
            "MC_TRIALS = 20_000",
            "MC_LOG2_NS = (0, 4)",
            "BLOCK_SIZES = (1, 64)",
            "BLOCK_LOG2_NS = (4, 6)",
            "BLOCK_KEYS = 2",
            "FL_ROUNDS = 2",
        ]
    ),
}


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ has no notebook"
    assert {p.name for p in NOTEBOOKS} == set(TEST_PARAMETERS), "give every notebook its test sizes"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_outputs(path):
    """Before: the notebooks were committed without outputs, so no plot showed on the repository page."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), (
        f"{path.name}: run python -m experiments.refresh_notebooks"
    )
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "executed top to bottom, once"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name}: no plot in the committed outputs"
    assert not notebook_errors(nb)
    assert not any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)


# Each execution starts a kernel and compiles a notebook's programs afresh (20-45 s each from an empty
# compilation cache): `make test-all` and CI run them, `make test` does not.
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = execute_notebook(path, TEST_PARAMETERS[path.name])
    assert not notebook_errors(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
