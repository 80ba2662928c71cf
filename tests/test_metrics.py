"""sidejax.metrics and the evaluators of sidejax.fl.evaluate: numpy float64 oracles, the ECE cases of
docs/papers/bpcfl.md#t12, batching exactness, and single / ensemble / personal evaluators against each
other."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.fl import Evaluation
from sidejax.fl.evaluate import (
    EvalResult,
    build_algorithm_evaluator,
    build_ensemble_evaluator,
    build_evaluator,
    build_personal_evaluator,
    client_mean,
)
from sidejax.metrics import (
    accuracy,
    calibration_bin_stats,
    classification_stats,
    ece,
    ece_bin_stats,
    ece_from_stats,
    log_predictive,
    nll,
    nll_from_stats,
    predictive_average,
    sum_stats,
)

EPS32 = float(np.finfo(np.float32).eps)


def temperature_model(variables, x, train):
    """A "model" whose inputs are logits: ``apply_fn({'params': {'t': t}}, z) = t · z``."""
    del train
    return x * variables["params"]["t"]


def random_problem(n: int = 203, num_classes: int = 7, seed: int = 0):
    """Logits of mixed sharpness, labels that agree with the argmax 60% of the time, ~20% padding rows."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(n, num_classes)) * rng.uniform(0.2, 6.0, size=(n, 1))).astype(np.float32)
    y = np.where(rng.random(n) < 0.6, logits.argmax(-1), rng.integers(0, num_classes, n)).astype(np.int32)
    mask = rng.random(n) < 0.8
    return logits, y, mask


def log_softmax64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def oracle(log_probs: np.ndarray, y: np.ndarray, mask: np.ndarray, num_bins: int = 10):
    """float64 metrics of the valid rows: (#correct, n, nll, ece, distance of the nearest confidence to a bin
    edge). Bins are ((b-1)/B, b/B] as in docs/papers/bpcfl.md#a9: b = ceil(conf·B)."""
    lp, yv = log_probs[mask].astype(np.float64), y[mask]
    correct = lp.argmax(-1) == yv
    conf = np.exp(lp.max(-1))
    b = np.clip(np.ceil(conf * num_bins).astype(int), 1, num_bins)
    gap = sum(abs(correct[b == k].sum() - conf[b == k].sum()) for k in range(1, num_bins + 1))
    edge = np.min(np.abs(conf[:, None] - np.arange(1, num_bins + 1) / num_bins))
    return int(correct.sum()), len(yv), -np.mean(lp[np.arange(len(yv)), yv]), gap / len(yv), edge


def assert_metrics_match_oracle(result, want) -> None:
    """float32 metrics against the float64 oracle. The counts are exact and accuracy is
    ``num_correct · (1 / n)`` in float32 (see sidejax.metrics._ratio); NLL and ECE are float32 sums
    (measured error <= ~1 ULP), held to 8 ULPs of their scale (the NLL's value; 1 for ECE, a mean of
    confidences <= 1). A bug (a padding row counted, an example in the wrong bin) moves them by
    ~1/n >= 1e-3, four orders of magnitude more."""
    num_correct, n, want_nll, want_ece, edge = want
    assert edge > 8 * EPS32  # no float32 confidence can fall on the other side of a bin edge
    assert int(result.num_examples) == n
    assert float(result.accuracy) == np.float32(num_correct) * (np.float32(1) / np.float32(n))
    np.testing.assert_allclose(
        float(result.loss), want_nll, rtol=0, atol=8 * np.spacing(np.float32(want_nll))
    )
    np.testing.assert_allclose(float(result.ece), want_ece, rtol=0, atol=8 * EPS32)


def test_metric_functions_and_summed_batch_stats_match_float64_oracle():
    logits, y, mask = random_problem()
    want = oracle(log_softmax64(logits), y, mask)
    lp = log_predictive(jnp.asarray(logits))
    yj, mj = jnp.asarray(y), jnp.asarray(mask)
    metrics = jax.jit(lambda *a: (accuracy(*a), nll(*a), ece(*a)))(lp, yj, mj)
    direct = EvalResult(metrics[0], metrics[1], jnp.int32(mask.sum()), metrics[2])
    assert_metrics_match_oracle(direct, want)
    # stats of uneven chunks add up: the integer parts exactly, the float parts to rounding
    stats_fn = jax.jit(classification_stats)
    cuts = [0, 1, 50, 130, 203]
    parts = [stats_fn(lp[a:b], yj[a:b], mj[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    total = sum_stats(jax.tree.map(lambda *leaves: jnp.stack(leaves), *parts))
    whole = stats_fn(lp, yj, mj)
    for got, ref in zip(jax.tree.leaves(total), jax.tree.leaves(whole), strict=True):
        if jnp.issubdtype(got.dtype, jnp.integer):
            np.testing.assert_array_equal(got, ref)
    np.testing.assert_allclose(float(nll_from_stats(total)), float(direct.loss), rtol=4 * EPS32)
    np.testing.assert_allclose(float(ece_from_stats(total.calibration)), float(direct.ece), atol=4 * EPS32)


def test_padding_rows_cannot_change_a_metric_and_no_valid_row_gives_zero():
    logits, y, mask = random_problem(n=40)
    lp = np.asarray(log_predictive(jnp.asarray(logits)))
    junk_lp, junk_y = lp.copy(), y.copy()
    junk_lp[~mask] = np.nan
    junk_y[~mask] = -7  # out of range labels on padding rows
    stats_fn = jax.jit(classification_stats)
    a = stats_fn(jnp.asarray(lp), jnp.asarray(y), jnp.asarray(mask))
    b = stats_fn(jnp.asarray(junk_lp), jnp.asarray(junk_y), jnp.asarray(mask.astype(np.float32)))
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)
    all_three = jax.jit(lambda *a: (accuracy(*a), nll(*a), ece(*a)))
    for value in all_three(jnp.asarray(junk_lp), jnp.asarray(junk_y), jnp.zeros(40, bool)):
        assert float(value) == 0.0 and not np.signbit(value)
    # a *valid* out-of-range label is an error, and shows: NaN, not a silently wrapped class
    assert np.isnan(float(nll(jnp.asarray(lp), jnp.asarray(np.full(40, -1, np.int32)))))


def test_ece_cases_of_the_spec():
    """docs/papers/bpcfl.md#t12."""
    bins = jax.jit(calibration_bin_stats)
    ece_of = jax.jit(lambda conf, correct: ece_from_stats(calibration_bin_stats(conf, correct)))
    n = 100
    # confidence 1 and all predictions correct: ECE = 0; 1.0 sits in the last bin (0.9, 1]
    assert float(ece_of(jnp.ones(n), jnp.ones(n, bool))) == 0.0
    np.testing.assert_array_equal(bins(jnp.ones(n), jnp.ones(n, bool)).count, [0] * 9 + [n])
    # all confidences 0.9 with accuracy 0.6: ECE = 0.3, up to the float32 rounding of 0.9 and of the bin's
    # confidence sum Σ conf = 90 (a few ULPs of 90, divided by n = 100) ...
    sixty = jnp.arange(n) < 60
    got = float(ece_of(jnp.full(n, 0.9, jnp.float32), sixty))
    np.testing.assert_allclose(got, 0.3, rtol=0, atol=4 * np.spacing(np.float32(90)) / n)
    # ... and with dyadic numbers, bit for bit: 128 confidences 0.875, accuracy 0.5 -> 0.375
    assert float(ece_of(jnp.full(128, 0.875, jnp.float32), jnp.arange(128) < 64)) == 0.375
    # bin edges: b/10 (as float32) is in bin b ((b-1)/10, b/10]; the next float up is in bin b+1
    edges = np.arange(1, 11, dtype=np.float32) / np.float32(10)
    at = bins(jnp.asarray(edges), jnp.ones(10, bool))
    np.testing.assert_array_equal(at.count, np.ones(10))
    np.testing.assert_array_equal(at.confidence, edges)  # edge b/10 is alone in bin b
    above = np.nextafter(edges[:-1], np.float32(2))
    np.testing.assert_array_equal(bins(jnp.asarray(above), jnp.ones(9, bool)).count, [0] + [1] * 9)
    # a predictive with confidence exactly 1 (log p = 0) from log-probabilities
    lp = jnp.array([[0.0, -jnp.inf], [jnp.log(0.25), jnp.log(0.75)]])
    np.testing.assert_array_equal(ece_bin_stats(lp, jnp.array([0, 1])).count, [0] * 7 + [1, 0, 1])
    # perfectly calibrated data: ECE -> 0 as n grows (y ~ Bernoulli(conf); sampling error ~ sqrt(B/n))
    rng = np.random.default_rng(1)
    values = []
    for size in (1_000, 100_000):
        conf = rng.uniform(0.5, 1.0, size).astype(np.float32)
        values.append(float(ece_of(conf, rng.random(size) < conf)))
    assert values[1] < values[0] and values[1] < 3 * np.sqrt(10 / 100_000)


def test_predictive_average_math():
    rng = np.random.default_rng(2)
    z = (rng.normal(size=(5, 30, 4)) * 3).astype(np.float32)
    want = np.log(np.exp(log_softmax64(z)).mean(0))
    got = np.asarray(predictive_average(jnp.asarray(z)))
    # float32 log-softmax, exp, mean and log of values |log p̄| <= ~15: a few ULPs of the largest
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * np.spacing(np.float32(np.abs(want).max())))
    np.testing.assert_array_equal(predictive_average(jnp.moveaxis(jnp.asarray(z), 0, 1), axis=1), got)
    # S identical samples: the model's own log-softmax, bit for bit when S · fl(1/S) = 1 (S = 4); else
    # (S = 41: 41 · fl(1/41) = 1 - 2^-24 in float32) to the float32 log's error at 1 - 2^-24 (measured
    # 1.5 · 2^-23) plus the rounding of l + log(mean): within 2 · 2^-23 + ULP(l); S = 1: itself
    lp = np.asarray(log_predictive(jnp.asarray(z[0])))
    same = jax.jit(lambda s: predictive_average(jnp.broadcast_to(z[0], (s, 30, 4))), static_argnums=0)
    np.testing.assert_array_equal(same(4), lp)
    assert np.float32(41) * (np.float32(1) / np.float32(41)) != 1
    assert np.all(np.abs(np.asarray(same(41)) - lp) <= np.spacing(np.abs(lp)) + 2 * EPS32)
    np.testing.assert_array_equal(predictive_average(jnp.asarray(z[:1])), lp)
    # a class every sample rules out stays -inf (not NaN); Jensen: ensemble NLL <= mean member NLL
    ruled_out = jnp.asarray(z).at[:, :, 0].set(-jnp.inf)
    avg = predictive_average(ruled_out)
    assert np.all(np.isneginf(avg[:, 0])) and np.all(np.isfinite(avg[:, 1:]))
    y = jnp.asarray(rng.integers(0, 4, 30).astype(np.int32))
    members = [float(nll(log_predictive(jnp.asarray(zs)), y)) for zs in z]
    assert float(nll(predictive_average(jnp.asarray(z)), y)) <= np.mean(members)
    with pytest.raises(ValueError, match="axis"):
        predictive_average(jnp.asarray(z), axis=-1)


def test_metric_argument_errors():
    lp, y = jnp.zeros((4, 3)), jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match="y must have shape"):
        nll(lp, jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match="integer class labels"):
        accuracy(lp, jnp.zeros(4))
    with pytest.raises(ValueError, match="mask must have the shape"):
        ece(lp, y, jnp.ones(3))
    with pytest.raises(ValueError, match="num_bins"):
        ece(lp, y, num_bins=0)
    with pytest.raises(ValueError, match="batch_size"):
        build_evaluator(temperature_model, batch_size=0)
    with pytest.raises(ValueError, match="samples_per_step"):
        build_ensemble_evaluator(temperature_model, samples_per_step=0)
    evaluate = build_personal_evaluator(temperature_model)
    with pytest.raises(ValueError, match="2 clients"):
        evaluate({"t": jnp.ones(2)}, jnp.zeros((3, 5, 4)), jnp.zeros((3, 5), jnp.int32))
    with pytest.raises(ValueError, match="leading client axis"):
        evaluate({"t": jnp.ones(3), "u": jnp.ones(2)}, jnp.zeros((3, 5, 4)), jnp.zeros((3, 5), jnp.int32))


def test_evaluators_match_float64_oracle_with_padding_that_does_not_divide_the_batch():
    """203 examples in batches of 50 (47 padding rows in the last batch) and ~20% masked rows."""
    logits, y, mask = random_problem()
    x, yj, mj = jnp.asarray(logits), jnp.asarray(y), jnp.asarray(mask)
    single = jax.jit(build_evaluator(temperature_model, batch_size=50))
    assert_metrics_match_oracle(
        single({"t": jnp.float32(1)}, x, yj, mj), oracle(log_softmax64(logits), y, mask)
    )
    # the unmasked call (today's signature) evaluates every row
    assert_metrics_match_oracle(
        single({"t": jnp.float32(1)}, x, yj), oracle(log_softmax64(logits), y, np.ones_like(mask))
    )
    # an ensemble of temperatures: the metrics of log (1/S) Σ_s softmax(t_s z)
    t = np.array([1.0, 0.5, 2.0, 0.8], np.float32)
    pbar = np.log(np.exp(log_softmax64(t[:, None, None].astype(np.float64) * logits)).mean(0))
    for per_step in (1, 3):  # one sample at a time, and vmapped 3 at a time (+ a remainder of 1)
        ens = jax.jit(build_ensemble_evaluator(temperature_model, batch_size=50, samples_per_step=per_step))
        assert_metrics_match_oracle(ens({"t": jnp.asarray(t)}, x, yj, mj), oracle(pbar, y, mask))
    # unmasked: n = 203 is a compile-time constant (XLA would turn a division by it into a product)
    assert_metrics_match_oracle(ens({"t": jnp.asarray(t)}, x, yj), oracle(pbar, y, np.ones_like(mask)))


def _assert_results_equal(got: EvalResult, want: EvalResult) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_algorithm_evaluator_composes_the_model_evaluators_as_the_evaluation_says():
    """``build_algorithm_evaluator`` reads the models from the state with the ``Evaluation``'s functions and
    scores them with the same compiled evaluators a driver would build by hand (bit for bit): one model by
    ``build_evaluator``, an ensemble by ``build_ensemble_evaluator``, personal models by
    ``build_personal_evaluator`` pooled by ``client_mean``."""
    logits, y, mask = random_problem(n=120)
    x, yj = jnp.asarray(logits), jnp.asarray(y)
    client_test = (x.reshape(3, 40, -1), yj.reshape(3, 40), jnp.asarray(mask).reshape(3, 40))
    state = {"t": jnp.float32(1.5), "ts": jnp.array([1.0, 0.5, 2.0], jnp.float32)}
    one = Evaluation(lambda s: {"t": s["t"]})
    evaluate = build_algorithm_evaluator(one, temperature_model, batch_size=50)
    got = evaluate(state, (x, yj))
    assert got.personal is None
    _assert_results_equal(
        got.model, jax.jit(build_evaluator(temperature_model, batch_size=50))({"t": 1.5}, x, yj)
    )
    with pytest.raises(ValueError, match="client_test was given, but the evaluation has no personal models"):
        evaluate(state, (x, yj), client_test)
    # an ensemble of three temperatures, and the same three as the clients' personal models
    both = Evaluation(lambda s: {"t": s["ts"]}, ensemble=True, personal=lambda s: {"t": s["ts"]})
    evaluate = build_algorithm_evaluator(both, temperature_model, batch_size=50)
    got = evaluate(state, (x, yj, jnp.asarray(mask)), client_test)
    ensemble = jax.jit(build_ensemble_evaluator(temperature_model, batch_size=50))
    _assert_results_equal(got.model, ensemble({"t": state["ts"]}, x, yj, jnp.asarray(mask)))
    personal = jax.jit(build_personal_evaluator(temperature_model, batch_size=50))
    _assert_results_equal(got.personal, client_mean(personal({"t": state["ts"]}, *client_test)))
    with pytest.raises(ValueError, match="client_test .* is required: the evaluation has personal models"):
        evaluate(state, (x, yj))


@pytest.mark.parametrize(
    "evaluation, match",
    [
        (lambda s: s, "evaluation must be a sidejax.fl.Evaluation, got function"),
        (Evaluation(None), "evaluation.params must be callable"),
        (Evaluation(lambda s: s, ensemble="sample"), "evaluation.ensemble must be a bool, got 'sample'"),
        (Evaluation(lambda s: s, personal={"t": 1}), "evaluation.personal must be None or callable"),
    ],
)
def test_algorithm_evaluator_refuses_a_malformed_evaluation(evaluation, match):
    with pytest.raises(ValueError, match=match):
        build_algorithm_evaluator(evaluation, temperature_model)


@pytest.fixture(scope="module")
def mlp_eval(small_model, digits):
    spec, params, _ = small_model
    _, test = digits
    return spec.module.apply, params, jnp.asarray(test.x), jnp.asarray(test.y)


def test_ensemble_of_one_and_of_identical_samples_equals_the_single_evaluator(mlp_eval):
    apply_fn, params, x, y = mlp_eval
    single = jax.jit(build_evaluator(apply_fn, batch_size=100))(params, x, y)
    ensemble = jax.jit(build_ensemble_evaluator(apply_fn, batch_size=100))
    stack = lambda s: jax.tree.map(lambda a: jnp.stack([a] * s), params)
    one = ensemble(stack(1), x, y)
    for got, want in zip(one, single, strict=True):  # S = 1: the same computation, bit for bit
        np.testing.assert_array_equal(got, want)
    # S = 4 copies: each model's logits come from its own apply_fn call inside the sample loop, a different
    # compiled program from the single evaluator's, so they may differ from the single model's in the last
    # bits (XLA fuses and orders float reductions per program: 1-3 ULP seen across machines, see
    # tests/test_fl.py). Given equal logits, the predictive average of identical samples is exact
    # (Σ_s exp(0) / S = 1, see predictive_average), so the metrics agree to a few ULPs of their scale.
    four = ensemble(stack(4), x, y)
    assert int(four.num_examples) == int(single.num_examples) and float(four.accuracy) == float(
        single.accuracy
    )
    np.testing.assert_allclose(four.loss, single.loss, rtol=0, atol=4 * np.spacing(np.float32(single.loss)))
    np.testing.assert_allclose(four.ece, single.ece, rtol=0, atol=4 * EPS32)


@pytest.mark.slow  # 12.5 s from an empty compilation cache (a loop of single evaluations, each compiled)
def test_personal_evaluator_equals_a_loop_of_single_evaluations(mlp_eval):
    apply_fn, params, x, y = mlp_eval
    sizes = np.array([37, 50, 0, 12])  # padded to 50; batch 16 divides none of them; one empty client
    scales = jnp.array([1.0, 1.5, 0.7, 2.0])
    stacked = jax.tree.map(lambda a: a[None] * scales.reshape(-1, *[1] * a.ndim), params)
    xs, ys = x[:200].reshape(4, 50, 8, 8, 1), y[:200].reshape(4, 50)
    mask = jnp.arange(50)[None] < sizes[:, None]
    personal = jax.jit(build_personal_evaluator(apply_fn, batch_size=16))(stacked, xs, ys, mask)
    single = jax.jit(build_evaluator(apply_fn, batch_size=16))
    loop = [
        single(jax.tree.map(lambda a, c=c: a[c], stacked), xs[c, : sizes[c]], ys[c, : sizes[c]])
        for c in range(4)
    ]
    np.testing.assert_array_equal(personal.num_examples, sizes)
    np.testing.assert_array_equal(personal.accuracy, [r.accuracy for r in loop])
    # two compiled programs summing the same floats in differently shaped batches: equal to a few ULPs
    np.testing.assert_allclose(
        personal.loss, [r.loss for r in loop], rtol=0, atol=4 * np.spacing(np.float32(3))
    )
    np.testing.assert_allclose(personal.ece, [r.ece for r in loop], rtol=0, atol=4 * EPS32)
    assert float(personal.loss[2]) == float(personal.accuracy[2]) == float(personal.ece[2]) == 0.0
    # clients vmapped 3 at a time (with a remainder of 1) compute the same thing
    vmapped = jax.jit(build_personal_evaluator(apply_fn, batch_size=16, clients_per_step=3))(
        stacked, xs, ys, mask
    )
    np.testing.assert_array_equal(vmapped.accuracy, personal.accuracy)
    np.testing.assert_allclose(vmapped.loss, personal.loss, rtol=0, atol=4 * np.spacing(np.float32(3)))
    # the example-weighted mean: pooled accuracy and NLL; mean client ECE >= the ECE of the pooled examples
    mean = client_mean(personal)
    correct = sum(round(float(r.accuracy) * int(r.num_examples)) for r in loop)
    assert int(mean.num_examples) == sizes.sum()
    np.testing.assert_allclose(float(mean.accuracy), correct / sizes.sum(), rtol=4 * EPS32)
    pooled_nll = sum(float(r.loss) * int(r.num_examples) for r in loop) / sizes.sum()
    np.testing.assert_allclose(float(mean.loss), pooled_nll, rtol=4 * EPS32)
    log_probs = jnp.concatenate(
        [
            log_predictive(apply_fn({"params": jax.tree.map(lambda a, c=c: a[c], stacked)}, xs[c]))
            for c in range(4)
        ]
    )
    assert float(mean.ece) >= float(ece(log_probs, ys.reshape(-1), mask.reshape(-1))) - 4 * EPS32
