"""Host-side (numpy) partitioning of a dataset across federated clients.

Every partitioner is deterministic given its integer ``seed`` and returns a ``list`` with one ``int64``
index array per client, sorted ascending. Unless stated otherwise (``fixed_size_partition``), the client
index sets are disjoint and together cover every example exactly once.

:func:`label_split_train_test` (pFedMe's split) is different: it draws a fixed number of examples per
(client, label) from a pooled train+test set and returns *two* lists, each client's train and test indices
(disjoint, not covering every example); it is not one of the :func:`partition` kinds.

These functions run once, on the host, before training; the result is typically passed to
:func:`sidejax.data.make_federated_data`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "PARTITION_KINDS",
    "dirichlet_partition",
    "fixed_size_partition",
    "iid_partition",
    "klms_noniid_partition",
    "label_shard_partition",
    "label_split_train_test",
    "partition",
]

# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_int(value: Any, arg: str, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{arg} must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def _check_seed(seed: Any) -> int:
    return _check_int(seed, "seed", 0)


def _check_num_examples(num_examples: Any) -> int:
    return _check_int(num_examples, "num_examples", 1)


def _check_num_clients(num_clients: Any, num_examples: int) -> int:
    if not _is_int(num_clients) or not 1 <= num_clients <= num_examples:
        raise ValueError(
            f"num_clients must be an integer between 1 and the number of examples ({num_examples}); "
            f"got {num_clients!r}."
        )
    return int(num_clients)


def _check_labels(labels: Any) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array of class labels; got shape {arr.shape}.")
    if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        raise ValueError(f"labels must have an integer dtype (class labels); got dtype {arr.dtype}.")
    return arr


def _sorted_int64(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _class_pools(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled example indices of each class present, in ascending class order."""
    order = np.argsort(labels, kind="stable")
    _, starts = np.unique(labels[order], return_index=True)
    return [rng.permutation(idx) for idx in np.split(order, starts[1:])]


# --------------------------------------------------------------------------------------------------
# Partitioners
# --------------------------------------------------------------------------------------------------


def iid_partition(num_examples: int, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Splits a random permutation of the examples as evenly as possible (``np.array_split``).

    Args:
        num_examples: Number of examples ``N`` (>= 1).
        num_clients: Number of clients, between 1 and ``N``.
        seed: Non-negative integer seed.

    Returns:
        ``num_clients`` sorted ``int64`` index arrays whose sizes differ by at most one.

    Raises:
        ValueError: If an argument is out of range.
    """
    num_examples = _check_num_examples(num_examples)
    num_clients = _check_num_clients(num_clients, num_examples)
    rng = np.random.default_rng(_check_seed(seed))
    return _sorted_int64(np.array_split(rng.permutation(num_examples), num_clients))


def _allocate_shards(counts: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder apportionment of ``total`` shards over classes of sizes ``counts``.

    Every class gets at least one shard and at most ``counts[k]`` (so no shard is empty). Requires
    ``len(counts) <= total <= counts.sum()``.
    """
    quotas = total * counts / counts.sum()
    alloc = np.clip(np.floor(quotas).astype(np.int64), 1, counts)
    # Hand out missing shards by largest remainder, taking away surplus (from the "at least one" floor)
    # by smallest remainder; each step changes one class, so this loops at most ~num_classes times.
    while alloc.sum() < total:
        gap = np.where(alloc < counts, quotas - alloc, -np.inf)
        alloc[np.argmax(gap)] += 1
    while alloc.sum() > total:
        gap = np.where(alloc > 1, quotas - alloc, np.inf)
        alloc[np.argmin(gap)] -= 1
    return alloc


def label_shard_partition(labels: Any, num_clients: int, *, c_max: int, seed: int) -> list[np.ndarray]:
    """Class-pure shard partition: every client holds at most ``c_max`` distinct classes.

    The examples are cut into ``num_clients * c_max`` shards, each containing a single class. Each class
    gets a number of shards proportional to its size (largest-remainder rounding, at least one per class,
    never more shards than examples), its shuffled indices are split into those shards with
    ``np.array_split``, and the shuffled shards are dealt ``c_max`` to each client. Every example is
    used exactly once, and ``c_max`` is a hard limit (a client can hold fewer distinct classes when two
    of its shards share a class).

    Args:
        labels: 1-D integer class labels, one per example.
        num_clients: Number of clients, between 1 and ``len(labels)``.
        c_max: Shards per client, i.e. maximum number of distinct classes per client; between 1 and the
            number of classes present.
        seed: Non-negative integer seed.

    Returns:
        ``num_clients`` sorted ``int64`` index arrays.

    Raises:
        ValueError: If ``c_max`` is out of range, if ``num_clients * c_max`` is smaller than the number
            of classes (the classes cannot all be covered) or larger than ``len(labels)`` (some shard
            would be empty), or if another argument is invalid.
    """
    labels = _check_labels(labels)
    n = labels.size
    num_clients = _check_num_clients(num_clients, n)
    rng = np.random.default_rng(_check_seed(seed))
    num_classes = np.unique(labels).size
    if not _is_int(c_max) or not 1 <= c_max <= num_classes:
        raise ValueError(
            f"c_max must be an integer between 1 and the number of classes present ({num_classes}); "
            f"got {c_max!r}."
        )
    c_max = int(c_max)
    total = num_clients * c_max
    if total < num_classes:
        raise ValueError(
            f"num_clients * c_max = {num_clients} * {c_max} = {total} shards cannot cover all "
            f"{num_classes} classes; increase num_clients or c_max so that num_clients * c_max >= "
            f"{num_classes}."
        )
    if total > n:
        raise ValueError(
            f"num_clients * c_max = {total} shards exceed the {n} examples, so some shard would be empty; "
            "decrease num_clients or c_max."
        )

    pools = _class_pools(labels, rng)
    counts = np.array([p.size for p in pools], dtype=np.int64)
    alloc = _allocate_shards(counts, total)
    shards: list[np.ndarray] = []
    for pool, k in zip(pools, alloc, strict=True):
        shards.extend(np.array_split(pool, k))
    order = rng.permutation(total).reshape(num_clients, c_max)
    return _sorted_int64([np.concatenate([shards[s] for s in row]) for row in order])


def klms_noniid_partition(
    labels: Any,
    num_clients: int,
    *,
    c_max: int,
    seed: int,
    min_weight: int = 10,
    max_weight: int = 100,
) -> list[np.ndarray]:
    """The non-iid split of the KLMS paper (Isik et al., App. E, following the authors' code).

    Client ``n`` draws a weight ``j_n`` uniformly from ``{min_weight, ..., max_weight - 1}`` (like
    ``randint(min_weight, max_weight)``) and receives ``floor(j_n / sum(j) * N)`` examples, the
    remainder of the rounding going to the last client. Its per-class quota is
    ``max(1, size // c_max)``: starting at a random class, it takes ``min(quota, left in class,
    left in budget)`` shuffled examples from consecutive classes, cyclically, until its budget is met.

    Note:
        Here ``c_max`` is only a *target* number of classes per client: when the classes it visits run
        out of examples, a client spills over into further classes and can end up holding more than
        ``c_max`` of them. Use :func:`label_shard_partition` for a hard limit. Every example is used
        exactly once.

    Args:
        labels: 1-D integer class labels, one per example.
        num_clients: Number of clients, between 1 and ``len(labels)``.
        c_max: Target number of classes per client (>= 1).
        seed: Non-negative integer seed.
        min_weight: Smallest client weight (>= 1).
        max_weight: Exclusive upper bound of the client weights (> ``min_weight``).

    Returns:
        ``num_clients`` sorted ``int64`` index arrays with sizes proportional to the weights.

    Raises:
        ValueError: If an argument is out of range, or if the drawn sizes leave some client without
            examples (too many clients for the dataset).
    """
    labels = _check_labels(labels)
    n = labels.size
    num_clients = _check_num_clients(num_clients, n)
    c_max = _check_int(c_max, "c_max", 1)
    min_weight = _check_int(min_weight, "min_weight", 1)
    if not _is_int(max_weight) or max_weight <= min_weight:
        raise ValueError(f"max_weight must be an integer > min_weight ({min_weight}); got {max_weight!r}.")
    rng = np.random.default_rng(_check_seed(seed))

    weights = rng.integers(min_weight, int(max_weight), size=num_clients)
    sizes = np.floor(weights / weights.sum() * n).astype(np.int64)
    sizes[-1] = n - sizes[:-1].sum()
    if np.any(sizes == 0):
        raise ValueError(
            f"num_clients={num_clients} is too large for {n} examples: some client would receive no "
            "examples; use fewer clients."
        )

    pools = _class_pools(labels, rng)
    num_classes = len(pools)
    taken = np.zeros(num_classes, dtype=np.int64)
    remaining = np.array([p.size for p in pools], dtype=np.int64)
    parts = []
    for size in sizes:
        quota = max(1, int(size) // c_max)
        budget = int(size)
        k = int(rng.integers(num_classes))
        chunks = []
        # Terminates: the budgets sum to N, so examples remain whenever budget > 0.
        while budget > 0:
            t = min(quota, int(remaining[k]), budget)
            if t > 0:
                chunks.append(pools[k][taken[k] : taken[k] + t])
                taken[k] += t
                remaining[k] -= t
                budget -= t
            k = (k + 1) % num_classes
        parts.append(np.concatenate(chunks))
    return _sorted_int64(parts)


def dirichlet_partition(
    labels: Any,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_examples: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Dirichlet label-skew partition (Hsu et al., 2019).

    For each class, client proportions ``p ~ Dirichlet(alpha * ones(num_clients))`` are drawn and the
    class's shuffled indices are split at the cumulative proportions. Small ``alpha`` gives strongly
    skewed label distributions, large ``alpha`` approaches iid. If some client gets fewer than
    ``min_examples`` examples, the whole draw is repeated (the random stream continues), at most
    ``max_tries`` times.

    Args:
        labels: 1-D integer class labels, one per example.
        num_clients: Number of clients, between 1 and ``len(labels)``.
        alpha: Dirichlet concentration (> 0, finite).
        seed: Non-negative integer seed.
        min_examples: Minimum number of examples per client (>= 0, with
            ``num_clients * min_examples <= len(labels)``).
        max_tries: Maximum number of draws (>= 1).

    Returns:
        ``num_clients`` sorted ``int64`` index arrays.

    Raises:
        ValueError: If an argument is out of range, or if no draw within ``max_tries`` satisfies
            ``min_examples`` (suggests a larger ``alpha`` or fewer clients).
    """
    labels = _check_labels(labels)
    n = labels.size
    num_clients = _check_num_clients(num_clients, n)
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float | np.number)
        or not np.isfinite(alpha)
        or alpha <= 0
    ):
        raise ValueError(f"alpha must be a finite number > 0; got {alpha!r}.")
    min_examples = _check_int(min_examples, "min_examples", 0)
    if num_clients * min_examples > n:
        raise ValueError(
            f"min_examples={min_examples} is impossible: num_clients * min_examples = "
            f"{num_clients * min_examples} exceeds the {n} examples."
        )
    max_tries = _check_int(max_tries, "max_tries", 1)
    rng = np.random.default_rng(_check_seed(seed))

    sizes = np.zeros(num_clients, dtype=np.int64)
    for _ in range(max_tries):
        per_client: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for pool in _class_pools(labels, rng):
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = np.floor(np.cumsum(p)[:-1] * pool.size).astype(np.int64)
            for c, chunk in enumerate(np.split(pool, cuts)):
                per_client[c].append(chunk)
        parts = [np.concatenate(chunks) for chunks in per_client]
        sizes = np.array([p.size for p in parts])
        if sizes.min() >= min_examples:
            return _sorted_int64(parts)
    raise ValueError(
        f"dirichlet_partition could not give every client at least min_examples={min_examples} examples "
        f"in max_tries={max_tries} draws (smallest client in the last draw: {sizes.min()}); use a larger "
        f"alpha (got {alpha}), fewer clients (num_clients={num_clients}), a smaller min_examples or a "
        "larger max_tries."
    )


def fixed_size_partition(
    num_examples: int, num_clients: int, *, examples_per_client: int, seed: int
) -> list[np.ndarray]:
    """Disjoint random subsets of a fixed size per client; the remaining examples are unused.

    This is CEPAM's setting (e.g. 30 clients with 1666 MNIST examples each).

    Args:
        num_examples: Number of examples ``N`` (>= 1).
        num_clients: Number of clients, between 1 and ``N``.
        examples_per_client: Examples per client (>= 1), with
            ``num_clients * examples_per_client <= N``.
        seed: Non-negative integer seed.

    Returns:
        ``num_clients`` sorted, disjoint ``int64`` index arrays of length ``examples_per_client``.

    Raises:
        ValueError: If an argument is out of range or the clients need more than ``N`` examples.
    """
    num_examples = _check_num_examples(num_examples)
    num_clients = _check_num_clients(num_clients, num_examples)
    examples_per_client = _check_int(examples_per_client, "examples_per_client", 1)
    if num_clients * examples_per_client > num_examples:
        raise ValueError(
            f"num_clients * examples_per_client = {num_clients} * {examples_per_client} = "
            f"{num_clients * examples_per_client} exceeds num_examples={num_examples}; decrease "
            "examples_per_client or num_clients."
        )
    rng = np.random.default_rng(_check_seed(seed))
    chosen = rng.permutation(num_examples)[: num_clients * examples_per_client]
    return _sorted_int64(list(chosen.reshape(num_clients, examples_per_client)))


def label_split_train_test(
    labels: Any,
    num_clients: int,
    *,
    labels_per_client: int,
    examples_per_label: int,
    train_fraction: float,
    seed: int,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """pFedMe's non-iid label split, with a train and a test set per client.

    Meant for the pooled train+test examples of a dataset (docs/papers/coreset_pfedbayes.md#s3-1). With
    ``L = labels_per_client`` and the ``C`` classes present (sorted, ``k``-th class ``c_k``), client ``u``
    holds the labels ``{c_((L*u + j) mod C) : j = 0..L-1}`` (10 clients, 5 labels, 10 classes: client
    ``u`` has ``{(5u + j) mod 10}``). Each (client, label) pair gets ``examples_per_label`` distinct
    examples of that label, drawn without replacement from the label's shuffled examples, so no example
    is given twice (across clients either). Each client's ``n = L * examples_per_label`` examples are
    shuffled and the first ``round(train_fraction * n)`` are its train set, the rest its test set
    (pFedMe/pFedBayes: 5 labels x 1000 examples, 20% train: 1000 train and 4000 test per client).
    Examples no client draws are unused.

    Args:
        labels: 1-D integer class labels of the pooled examples.
        num_clients: Number of clients (>= 1).
        labels_per_client: Labels per client ``L``, between 1 and the number of classes present.
        examples_per_label: Examples of each of its labels a client gets (>= 1).
        train_fraction: Fraction of a client's examples in its train set, in (0, 1); it must leave every
            client at least one train and one test example.
        seed: Non-negative integer seed (numpy ``default_rng``).

    Returns:
        ``(train, test)``: two lists of ``num_clients`` sorted ``int64`` arrays of indices into ``labels``;
        all ``2 * num_clients`` arrays are pairwise disjoint.

    Raises:
        ValueError: If an argument is out of range, or if some label has fewer examples than the clients
            holding it need (the message names the label, the numbers, and what to lower).
    """
    labels = _check_labels(labels)
    num_clients = _check_int(num_clients, "num_clients", 1)
    classes, counts = np.unique(labels, return_counts=True)
    num_classes = classes.size
    if not _is_int(labels_per_client) or not 1 <= labels_per_client <= num_classes:
        raise ValueError(
            f"labels_per_client must be an integer between 1 and the number of classes present "
            f"({num_classes}); got {labels_per_client!r}."
        )
    per_client = int(labels_per_client)
    per_label = _check_int(examples_per_label, "examples_per_label", 1)
    if (
        isinstance(train_fraction, bool)
        or not isinstance(train_fraction, int | float | np.number)
        or not 0 < train_fraction < 1
    ):
        raise ValueError(f"train_fraction must be a number in (0, 1); got {train_fraction!r}.")
    n = per_client * per_label
    num_train = round(float(train_fraction) * n)
    if not 1 <= num_train <= n - 1:
        raise ValueError(
            f"train_fraction={train_fraction} of a client's labels_per_client * examples_per_label = "
            f"{per_client} * {per_label} = {n} examples gives {num_train} train and {n - num_train} test "
            f"examples; every client needs at least one of each: choose train_fraction between {1 / n:.4g} "
            f"and {1 - 1 / n:.4g}, or give clients more examples."
        )
    seed = _check_seed(seed)

    # client u holds class positions (L*u + j) mod C; count how many clients hold each class
    held = (per_client * np.arange(num_clients)[:, None] + np.arange(per_client)[None, :]) % num_classes
    holders = np.bincount(held.ravel(), minlength=num_classes)
    for k in range(num_classes):
        need = int(holders[k]) * per_label
        if need > counts[k]:
            most = int(np.min(counts[holders > 0] // holders[holders > 0]))
            fix = f"lower examples_per_label to at most {most}, or " if most >= 1 else ""
            raise ValueError(
                f"label {classes[k]} has {counts[k]} examples but the {holders[k]} clients holding it need "
                f"{holders[k]} * examples_per_label = {holders[k]} * {per_label} = {need}; {fix}use fewer "
                f"clients (num_clients={num_clients}) or labels_per_client (={per_client})."
            )

    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, rng)
    taken = np.zeros(num_classes, dtype=np.int64)
    train, test = [], []
    for row in held:
        chunks = []
        for k in row:
            chunks.append(pools[k][taken[k] : taken[k] + per_label])
            taken[k] += per_label
        mine = rng.permutation(np.concatenate(chunks))
        train.append(mine[:num_train])
        test.append(mine[num_train:])
    return _sorted_int64(train), _sorted_int64(test)


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------


_PARTITIONERS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": iid_partition,
    "shards": label_shard_partition,
    "klms_noniid": klms_noniid_partition,
    "dirichlet": dirichlet_partition,
    "fixed": fixed_size_partition,
}

#: Kinds accepted by :func:`partition`.
PARTITION_KINDS: tuple[str, ...] = tuple(_PARTITIONERS)


def partition(kind: str, labels: Any, num_clients: int, *, seed: int, **kwargs: Any) -> list[np.ndarray]:
    """Partitions a dataset with the partitioner named ``kind``.

    Args:
        kind: One of ``"iid"`` (:func:`iid_partition`), ``"shards"`` (:func:`label_shard_partition`),
            ``"klms_noniid"`` (:func:`klms_noniid_partition`), ``"dirichlet"``
            (:func:`dirichlet_partition`) or ``"fixed"`` (:func:`fixed_size_partition`).
        labels: 1-D class labels, one per example (only their number is used by ``"iid"`` and
            ``"fixed"``).
        num_clients: Number of clients.
        seed: Non-negative integer seed.
        **kwargs: Keyword arguments of the chosen partitioner (e.g. ``c_max``, ``alpha``,
            ``examples_per_client``).

    Returns:
        One sorted ``int64`` index array per client.

    Raises:
        ValueError: For an unknown ``kind``, a keyword argument the partitioner does not accept, or any
            error of the partitioner itself.
    """
    if kind not in _PARTITIONERS:
        raise ValueError(f"kind must be one of {', '.join(PARTITION_KINDS)}; got {kind!r}.")
    fn = _PARTITIONERS[kind]
    params = inspect.signature(fn).parameters
    accepted = [p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY and p != "seed"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"Unknown keyword argument(s) {', '.join(unknown)} for partition kind {kind!r}; valid: "
            f"{', '.join(accepted) if accepted else 'none'}."
        )
    if kind in ("iid", "fixed"):
        arr = np.asarray(labels)
        if arr.ndim < 1 or arr.shape[0] == 0:
            raise ValueError(f"labels must be a non-empty array with one entry per example; got {arr.shape}.")
        return fn(arr.shape[0], num_clients, seed=seed, **kwargs)
    return fn(labels, num_clients, seed=seed, **kwargs)
