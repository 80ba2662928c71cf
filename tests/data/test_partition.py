"""Client partitions (sidejax.data.partition): coverage, determinism, class limits, imbalance, errors."""

from __future__ import annotations

import numpy as np
import pytest

from sidejax.data import (
    PARTITION_KINDS,
    class_counts,
    dirichlet_partition,
    fixed_size_partition,
    iid_partition,
    klms_noniid_partition,
    label_shard_partition,
    label_split_train_test,
    partition,
)


@pytest.fixture(scope="module")
def imbalanced_labels() -> np.ndarray:
    counts = [400, 300, 250, 200, 200, 150, 150, 150, 100, 100]  # 2000 examples, 10 classes
    labels = np.repeat(np.arange(10), counts)
    return np.random.default_rng(123).permutation(labels)


_COVERING_KINDS = {
    "iid": {},
    "shards": {"c_max": 2},
    "klms_noniid": {"c_max": 2},
    "dirichlet": {"alpha": 0.5},
}


def test_partition_kinds():
    assert set(PARTITION_KINDS) == {"iid", "shards", "klms_noniid", "dirichlet", "fixed"}


@pytest.mark.parametrize("kind", sorted(_COVERING_KINDS))
def test_partition_uses_every_sample_once(kind, imbalanced_labels):
    parts = partition(kind, imbalanced_labels, 10, seed=0, **_COVERING_KINDS[kind])
    assert len(parts) == 10
    for p in parts:
        assert p.dtype == np.int64 and p.size > 0 and np.all(np.diff(p) > 0)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(imbalanced_labels.size))


@pytest.mark.parametrize("kind", sorted(PARTITION_KINDS))
def test_partition_determinism(kind, imbalanced_labels):
    kwargs = _COVERING_KINDS.get(kind, {"examples_per_client": 100})
    a = partition(kind, imbalanced_labels, 10, seed=3, **kwargs)
    b = partition(kind, imbalanced_labels, 10, seed=3, **kwargs)
    c = partition(kind, imbalanced_labels, 10, seed=4, **kwargs)
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    assert not all(np.array_equal(u, v) for u, v in zip(a, c, strict=True))


def test_iid_sizes():
    parts = iid_partition(103, 10, seed=0)
    sizes = sorted(p.size for p in parts)
    assert sizes[0] == 10 and sizes[-1] == 11 and sum(sizes) == 103


@pytest.mark.parametrize("c_max", [1, 2, 4])
def test_shards_class_limit(c_max, imbalanced_labels):
    parts = label_shard_partition(imbalanced_labels, 20, c_max=c_max, seed=0)
    counts = class_counts(imbalanced_labels, parts, 10)
    assert counts.shape == (20, 10)
    assert np.all((counts > 0).sum(axis=1) <= c_max)
    assert np.all(counts.sum(axis=1) > 0)
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(imbalanced_labels))
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(imbalanced_labels.size))


def _mean_tv(labels, parts, num_classes):
    counts = class_counts(labels, parts, num_classes).astype(np.float64)
    local = counts / counts.sum(axis=1, keepdims=True)
    glob = np.bincount(labels, minlength=num_classes) / labels.size
    return float(np.mean(0.5 * np.abs(local - glob).sum(axis=1)))


def test_dirichlet_imbalance_grows_as_alpha_shrinks(imbalanced_labels):
    tvs = [
        _mean_tv(imbalanced_labels, dirichlet_partition(imbalanced_labels, 10, alpha=a, seed=0), 10)
        for a in (100.0, 1.0, 0.1)
    ]
    assert tvs[0] < tvs[1] < tvs[2], tvs


def test_dirichlet_min_examples_failure(imbalanced_labels):
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(imbalanced_labels, 200, alpha=0.001, seed=0, min_examples=5, max_tries=3)


def test_fixed_size_partition():
    parts = fixed_size_partition(50000, 30, examples_per_client=1666, seed=0)
    assert len(parts) == 30 and all(p.size == 1666 for p in parts)
    flat = np.concatenate(parts)
    assert np.unique(flat).size == flat.size and flat.max() < 50000 and flat.min() >= 0


def test_klms_noniid_sizes(imbalanced_labels):
    n, clients, seed = imbalanced_labels.size, 10, 5
    parts = klms_noniid_partition(imbalanced_labels, clients, c_max=2, seed=seed)
    sizes = np.array([p.size for p in parts])
    assert sizes.sum() == n
    weights = np.random.default_rng(seed).integers(10, 100, size=clients)  # the documented first draw
    assert np.all((weights >= 10) & (weights < 100))
    np.testing.assert_array_equal(sizes[:-1], np.floor(weights / weights.sum() * n)[:-1])
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    # c_max is a target: most clients stay within it.
    classes_per_client = (class_counts(imbalanced_labels, parts, 10) > 0).sum(axis=1)
    assert np.median(classes_per_client) <= 3


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda y: label_shard_partition(y, 10, c_max=11, seed=0), "c_max"),
        (lambda y: label_shard_partition(y, 10, c_max=0, seed=0), "c_max"),
        (lambda y: label_shard_partition(y, 3, c_max=2, seed=0), "num_clients"),
        (lambda y: label_shard_partition(y, 5000, c_max=1, seed=0), "num_clients"),
        (lambda y: iid_partition(y.size, y.size + 1, seed=0), "num_clients"),
        (lambda y: dirichlet_partition(y, y.size + 1, alpha=1.0, seed=0), "num_clients"),
        (lambda y: klms_noniid_partition(y, y.size + 1, c_max=2, seed=0), "num_clients"),
        (lambda y: fixed_size_partition(y.size, y.size + 1, examples_per_client=1, seed=0), "num_clients"),
        (lambda y: fixed_size_partition(y.size, 0, examples_per_client=1, seed=0), "num_clients"),
        (lambda y: dirichlet_partition(y, 10, alpha=0.0, seed=0), "alpha"),
        (lambda y: dirichlet_partition(y, 10, alpha=-1, seed=0), "alpha"),
        (lambda y: fixed_size_partition(y.size, 10, examples_per_client=-5, seed=0), "examples_per_client"),
        (lambda y: fixed_size_partition(y.size, 10, examples_per_client=201, seed=0), "examples_per_client"),
        (lambda y: partition("random", y, 10, seed=0), "kind"),
        (lambda y: partition("dirichlet", y, 10, seed=0, alpha=1.0, c_max=2), "c_max"),
        (lambda y: iid_partition(y.size, 10, seed=-1), "seed"),
        (lambda y: klms_noniid_partition(y, 10, c_max=2, seed=0, max_weight=5), "max_weight"),
    ],
)
def test_partition_bad_inputs(call, arg, imbalanced_labels):
    with pytest.raises(ValueError, match=arg):
        call(imbalanced_labels)


def test_partition_unknown_kind_lists_valid(imbalanced_labels):
    with pytest.raises(ValueError) as info:
        partition("random", imbalanced_labels, 10, seed=0)
    for kind in PARTITION_KINDS:
        assert kind in str(info.value)


# --------------------------------------------------------------------------------------------------
# label_split_train_test (pFedMe's split into per-client train and test sets)
# --------------------------------------------------------------------------------------------------


def _pfedme(labels, num_clients=10, **kw):
    args = {"labels_per_client": 5, "examples_per_label": 20, "train_fraction": 0.25, "seed": 0, **kw}
    return label_split_train_test(labels, num_clients, **args)


def test_label_split_gives_each_client_its_labels_sizes_and_disjoint_sets(imbalanced_labels):
    train, test = _pfedme(imbalanced_labels)
    assert len(train) == len(test) == 10
    for u, (tr, te) in enumerate(zip(train, test, strict=True)):
        assert tr.dtype == te.dtype == np.int64
        assert np.all(np.diff(tr) > 0) and np.all(np.diff(te) > 0)  # sorted, no repeats
        assert tr.size == 25 and te.size == 75  # 5 labels x 20 examples, 25% train
        # the paper's label set: {(5u + j) mod 10, j = 0..4}, 20 examples of each over train + test
        both = np.concatenate([tr, te])
        want = {(5 * u + j) % 10 for j in range(5)}
        assert set(imbalanced_labels[both].tolist()) == want
        assert np.bincount(imbalanced_labels[both], minlength=10)[sorted(want)].tolist() == [20] * 5
    everything = np.concatenate(train + test)
    assert np.unique(everything).size == everything.size == 10 * 100  # no example used twice


def test_label_split_label_sets_wrap_around_the_classes():
    labels = np.repeat(np.arange(7), 50)  # 7 classes, 3 labels per client, 4 clients
    train, test = label_split_train_test(
        labels, 4, labels_per_client=3, examples_per_label=10, train_fraction=0.5, seed=1
    )
    got = [sorted(set(labels[np.concatenate([tr, te])].tolist())) for tr, te in zip(train, test, strict=True)]
    assert got == [[0, 1, 2], [3, 4, 5], [0, 1, 6], [2, 3, 4]]  # {(3u + j) mod 7}
    assert all(tr.size == 15 and te.size == 15 for tr, te in zip(train, test, strict=True))


def test_label_split_uses_the_classes_present_in_order():
    labels = np.repeat(np.array([3, 8, 11]), 30)
    train, test = label_split_train_test(
        labels, 3, labels_per_client=2, examples_per_label=5, train_fraction=0.2, seed=0
    )
    got = [sorted(set(labels[np.concatenate([tr, te])].tolist())) for tr, te in zip(train, test, strict=True)]
    assert got == [[3, 8], [3, 11], [8, 11]]
    assert [tr.size for tr in train] == [2, 2, 2] and [te.size for te in test] == [8, 8, 8]


def test_label_split_is_deterministic(imbalanced_labels):
    a, b, c = _pfedme(imbalanced_labels), _pfedme(imbalanced_labels), _pfedme(imbalanced_labels, seed=1)
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, z) for x, z in zip(a[0], c[0], strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"labels_per_client": 0}, r"labels_per_client must be an integer between 1 and .* \(10\)"),
        ({"labels_per_client": 11}, "labels_per_client"),
        ({"labels_per_client": 2.0}, "labels_per_client"),
        ({"examples_per_label": 0}, "examples_per_label must be an integer >= 1"),
        ({"train_fraction": 0.0}, r"train_fraction must be a number in \(0, 1\)"),
        ({"train_fraction": 1.0}, "train_fraction"),
        ({"train_fraction": True}, "train_fraction"),
        ({"train_fraction": 0.001}, "gives 0 train and 100 test examples"),
        ({"train_fraction": 0.999}, "gives 100 train and 0 test examples"),
        ({"seed": -1}, "seed"),
        ({"num_clients": 0}, "num_clients"),
        # classes 8 and 9 have 100 examples, held by 5 clients each: at most 20 per (client, label)
        (
            {"examples_per_label": 21},
            r"label 8 has 100 examples but the 5 clients holding it need 5 \* examples_per_label = "
            r"5 \* 21 = 105; lower examples_per_label to at most 20",
        ),
    ],
)
def test_label_split_errors_name_the_argument(imbalanced_labels, kwargs, match):
    kwargs = dict(kwargs)
    num_clients = kwargs.pop("num_clients", 10)
    with pytest.raises(ValueError, match=match):
        _pfedme(imbalanced_labels, num_clients, **kwargs)


def test_label_split_error_when_a_label_has_fewer_examples_than_clients():
    labels = np.array([0] * 50 + [1] * 2)
    with pytest.raises(ValueError, match="label 1 has 2 examples but the 4 clients") as e:
        label_split_train_test(
            labels, 4, labels_per_client=2, examples_per_label=1, train_fraction=0.5, seed=0
        )
    assert "lower examples_per_label" not in str(e.value) and "use fewer clients" in str(e.value)


def test_label_split_is_not_a_partition_kind():
    assert "pfedme" not in PARTITION_KINDS
