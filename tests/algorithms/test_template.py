"""The algorithm template (docs/architecture.md#the-algorithm-template), checked mechanically: every public
builder in ``sidejax.algorithms`` has the common signature (or is listed with its reason), returns an
:class:`sidejax.fl.Algorithm` that declares its evaluation, and the settings types it takes are exported."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from helpers import every_algorithm

import sidejax.algorithms as algorithms
from sidejax.algorithms import pfedbayes_subset
from sidejax.fl import Algorithm, Evaluation, LocalTraining

#: the skeletons that make an Algorithm from a method value (the public builders above them are checked)
SKELETONS = {"dense_algorithm", "compressed_algorithm", "personalized_algorithm"}
#: the builder of each variant of :func:`helpers.every_algorithm` whose name is not its builder's
VARIANT_OF = {
    "fedpm_klms": "fedpm",
    "qsgd_klms": "qsgd",
    "signsgd_klms": "signsgd",
    "sgld_klms": "sgld",
    "bicompfl_pr_splitdl": "bicompfl_pr",
}


@pytest.fixture(scope="module")
def built(small_model):
    """``{builder name: Algorithm}``: every public builder called once, at small settings."""
    spec, _, loss = small_model
    by_builder = {VARIANT_OF.get(name, name): algo for name, algo in every_algorithm(loss, spec).items()}
    by_builder["pfedbayes_subset"] = pfedbayes_subset(loss, clients_per_round=3, subset_size=5)
    return by_builder


def _modules():
    return [
        importlib.import_module(f"sidejax.algorithms.{m.name}")
        for m in pkgutil.iter_modules(algorithms.__path__)
        if not m.name.startswith("_")
    ]


def _builders():
    """``{name: (module, function)}``: every function in a module's ``__all__`` annotated ``-> Algorithm``."""
    found = {}
    for module in _modules():
        for name in module.__all__:
            fn = getattr(module, name)
            if inspect.isfunction(fn) and inspect.signature(fn).return_annotation in ("Algorithm", Algorithm):
                found[name] = (module, fn)
    return found


BUILDERS = _builders()
PUBLIC = sorted(set(BUILDERS) - SKELETONS)


def test_every_public_builder_is_covered(built):
    assert SKELETONS <= set(BUILDERS)
    assert sorted(built) == PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_builder_has_the_common_signature(name):
    """``builder(loss_fn[, init_fn][, local: LocalTraining], *, clients_per_round | num_clients, ...,
    coder, ...)``: the loss first, the local training second where there is one, everything else keyword
    only; each settings type it takes is exported by its module and by ``sidejax.algorithms``."""
    module, fn = BUILDERS[name]
    params = inspect.signature(fn).parameters
    positional = [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = {p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert positional[0] == "loss_fn" and positional in (
        ["loss_fn"],
        ["loss_fn", "local"],
        ["loss_fn", "init_fn"],
    ), positional
    assert len(positional) + len(keyword) == len(params), "no *args / **kwargs"
    if "local" in params:
        assert params["local"].annotation in ("LocalTraining", LocalTraining)
    assert "coder" in keyword
    assert keyword & {"clients_per_round", "num_clients"}
    for p in params.values():
        settings = [t.strip() for t in str(p.annotation).split("|") if t.strip().endswith("Settings")]
        for type_name in settings:
            assert type_name in module.__all__ and type_name in algorithms.__all__, (p.name, type_name)


@pytest.mark.parametrize("name", PUBLIC)
def test_builder_returns_an_algorithm_that_declares_its_evaluation(name, built):
    algorithm = built[name]
    assert isinstance(algorithm, Algorithm)
    evaluation = algorithm.evaluation
    assert isinstance(evaluation, Evaluation) and callable(evaluation.params)
    assert isinstance(evaluation.ensemble, bool)
    assert evaluation.personal is None or callable(evaluation.personal)
    assert algorithm.eval_params is evaluation.params
    # only BPC-FL evaluates an ensemble (its posterior samples), only the pFedBayes family and the
    # personalized baselines of its tables personal models
    assert evaluation.ensemble == (name == "bpcfl")
    assert (evaluation.personal is not None) == (
        name in {"pfedbayes", "pfedbayes_subset", "coreset_pfedbayes", "pfedme", "perfedavg"}
    )
