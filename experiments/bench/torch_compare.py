"""Benchmark: LeNet5 local training in sidejax vs PyTorch on CPU, single-threaded, side by side in one run.

Setting (issue 12): one client's local training, one epoch over ``--examples`` Fashion-MNIST images (random
images of the same shape if the files are not installed, flagged in the JSON), SGD (learning rate 0.05,
momentum 0.9), softmax cross-entropy, a fresh random order each epoch, at each of ``--batch-sizes``. The
model is the same LeNet5 in both (61,706 parameters): PyTorch's copy is loaded with sidejax's initial
weights and its logits are checked against sidejax's before timing.

Contestants, each (batch size, contestant) timed in turn within each repeat (so machine load drifts over all
of them alike), median reported:

- ``sidejax``: :func:`sidejax.fl.local.build_local_trainer` (the ``lax.scan`` local trainer every FedAvg-type
  algorithm runs per client), jitted, with the models' convolution (:mod:`sidejax.models.conv`);
- ``no_banded`` and ``kernel_only`` (with ``--before``): the same, traced inside
  :func:`sidejax.models.conv.no_banded_matmul` (every convolution on the convolution path with canonical
  input and kernel gradients: issue 12's first change alone) and inside
  :func:`sidejax.models.conv.lax_input_gradient` (the convolution before issue 12: canonical kernel
  gradient, JAX's ``b01f_01oi`` input gradient): the before/after of both changes in the same run;
- ``lax`` (with ``--lax``): the same with plain ``lax.conv_general_dilated`` (slow: both gradients
  non-canonical inside the loop);
- ``torch``: the usual PyTorch loop (``zero_grad``, forward, ``backward``, ``step``) on NCHW tensors, batches
  gathered from the epoch's permutation as sidejax does. Skipped with a message, and recorded as
  ``"torch": null``, when PyTorch is not installed.

Threads and cores: ``--threads 1`` (default) asks both for one thread: ``torch.set_num_threads(1)`` (and one
inter-op thread) and, for XLA, ``--xla_cpu_multi_thread_eigen=false`` in ``XLA_FLAGS``, which must be set
before jax is imported: when jax is already imported (``main()`` called from Python), the benchmark re-runs
itself in a fresh interpreter. ``--threads 0`` leaves both libraries at their defaults. XLA's flag leaves
its intra-op pool at one thread per usable core (sidejax ran on about 1.7 cores against PyTorch's one before
the pinning), so both sides also run on the same cores: ``--cores`` (default: one core, the first this
process may use; ``all``: not pinned) is set with ``os.sched_setaffinity`` before jax is imported
(:func:`experiments.bench.common.run_pinned`; a re-run interpreter inherits it). Every contestant's CPU time
is recorded beside its wall time: pinned to one core, CPU / wall is about 1 on an idle machine.

Writes JSON (default ``results/bench/torch_compare.json``): the machine, threads, cores and load average
before and after (:func:`experiments.bench.common.machine_record`); per batch size, each contestant's wall
and CPU seconds per epoch (all repeats, median, best; :func:`experiments.bench.common.timing`), median
seconds per epoch and microseconds per example, ``sidejax_over_torch_time`` (the target of
issue 12 is <= 1.2 at batch 32), ``kernel_only_over_sidejax_time`` (the speed-up of both changes),
``kernel_only_over_no_banded_time`` (of the input-gradient change alone) and the per-example cost of batch
128 relative to batch 32 for each contestant, in wall and in CPU time.

Run: ``python -m experiments.bench.torch_compare [--batch-sizes 32,128] [--examples 6000] [--repeats 5]
[--cores 0] [--before] [--lax]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.bench.common import (
    THREAD_FLAGS,
    check_threads_and_cores,
    conv_context,
    fashion_mnist,
    interleave,
    load_average,
    machine_record,
    parser,
    run_pinned,
    timing,
    torch_single_thread,
    write_report,
)

#: the command line: flag -> (type, default, help)
FLAGS = {
    "--batch-sizes": (str, "32,128", "comma-separated batch sizes (default 32,128)"),
    "--examples": (int, 6000, "examples in the client's epoch (default 6000)"),
    "--repeats": (int, 5, "timed epochs per contestant (median reported)"),
    **THREAD_FLAGS,
    "--before": (bool, False, "also time no_banded and kernel_only (before issue 12)"),
    "--lax": (bool, False, "also time plain lax convolutions (slow)"),
    "--no-torch": (bool, False, "skip PyTorch even when it is installed"),
    "--output": (Path, Path("results/bench/torch_compare.json"), None),
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("experiments.bench.torch_compare", __doc__, FLAGS)
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    if any(b < 1 for b in args.batch_sizes) or args.examples < 1 or args.repeats < 1:
        p.error("--batch-sizes, --examples and --repeats must be >= 1")
    check_threads_and_cores(p, args)
    return args


def _import_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


class _Data:
    def __init__(self, n: int):
        self.x, self.y, self.real = fashion_mnist(n)
        if len(self.y) < n:
            raise SystemExit(f"--examples {n} exceeds the {len(self.y)} training images available")


def _sidejax_trainers(data: _Data, batch_size: int, variants: list[str]):
    """Jitted one-epoch local trainers ``() -> params`` (compiled and run once here), initial params."""
    import jax
    import jax.numpy as jnp
    import optax

    from sidejax.fl import classification_loss
    from sidejax.fl.base import ClientData
    from sidejax.fl.local import build_local_trainer
    from sidejax.keys import run_keys
    from sidejax.models import get_model, init_params

    spec = get_model("lenet5")
    init_key, client_key = run_keys(0)
    params = init_params(init_key, spec)
    n = len(data.y)
    client = ClientData(
        jnp.asarray(data.x), jnp.asarray(data.y), jnp.arange(n, dtype=jnp.int32), jnp.int32(n)
    )
    loss = classification_loss(spec.module.apply)
    trainers = {}
    for name in variants:
        train = jax.jit(
            build_local_trainer(loss, optax.sgd(0.05, momentum=0.9), batch_size=batch_size, num_epochs=1)
        )
        with conv_context(name):  # tracing happens in the first call
            jax.block_until_ready(train(client_key, params, client))
        trainers[name] = lambda train=train: jax.block_until_ready(train(client_key, params, client)[0])
    return trainers, params, spec


def _torch_trainer(torch, data: _Data, batch_size: int, params, spec):
    """PyTorch LeNet5 with sidejax's initial weights, logits checked; returns ``() -> None`` (one epoch)."""
    import numpy as np

    nn, F = torch.nn, torch.nn.functional

    class LeNet5(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
            self.conv2 = nn.Conv2d(6, 16, 5)
            self.fc1, self.fc2, self.fc3 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)

        def forward(self, x):
            x = F.avg_pool2d(F.relu(self.conv1(x)), 2)
            x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
            x = F.relu(self.fc1(x.flatten(1)))
            return self.fc3(F.relu(self.fc2(x)))

    model = LeNet5()
    p = {k: {n: np.asarray(v) for n, v in layer.items()} for k, layer in params.items()}
    t = lambda a: torch.from_numpy(np.array(a, np.float32))  # a writable copy
    with torch.no_grad():
        for name in ("conv1", "conv2"):
            getattr(model, name).weight.copy_(t(p[name]["kernel"].transpose(3, 2, 0, 1)))  # HWIO -> OIHW
            getattr(model, name).bias.copy_(t(p[name]["bias"]))
        # sidejax flattens [5, 5, 16] (h, w, c); PyTorch flattens [16, 5, 5] (c, h, w)
        fc1 = p["fc1"]["kernel"].reshape(5, 5, 16, 120).transpose(2, 0, 1, 3).reshape(400, 120)
        model.fc1.weight.copy_(t(fc1.T))
        model.fc1.bias.copy_(t(p["fc1"]["bias"]))
        for name in ("fc2", "fc3"):
            getattr(model, name).weight.copy_(t(p[name]["kernel"].T))
            getattr(model, name).bias.copy_(t(p[name]["bias"]))
    if sum(v.numel() for v in model.parameters()) != spec.num_params:
        raise AssertionError("PyTorch LeNet5 parameter count differs from sidejax's")
    x = torch.from_numpy(np.ascontiguousarray(data.x.transpose(0, 3, 1, 2)))  # NHWC -> NCHW
    y = torch.from_numpy(data.y.astype(np.int64))
    with torch.no_grad():
        got = model(x[:8]).numpy()
    want = np.asarray(spec.module.apply({"params": params}, data.x[:8]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg="PyTorch and sidejax LeNet5 differ")

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    n = len(y)

    def epoch():
        order = torch.randperm(n, generator=gen)
        for s in range(0, n, batch_size):
            idx = order[s : s + batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()

    epoch()  # warm-up
    return epoch


def _setup_torch(args):
    """PyTorch (or ``None``: ``--no-torch`` or not installed), single-threaded with ``--threads 1``."""
    torch = None if args.no_torch else _import_torch()
    if torch is None:
        why = "--no-torch" if args.no_torch else "PyTorch is not installed (pip install torch to compare)"
        print(f'skipping PyTorch: {why}; the JSON records "torch": null', flush=True)
    elif args.threads == 1:
        torch_single_thread(torch)
    return torch


def _time_epochs(by_batch: dict, repeats: int) -> dict:
    """``(wall, CPU)`` seconds of each ``repeats`` epoch of every (batch size, contestant), all of them in
    turn within each repeat: machine load drifts alike over all of them."""
    calls = {(b, name): fn for b, trainers in by_batch.items() for name, fn in trainers.items()}
    times = interleave(calls, repeats)[0]
    return {b: {name: times[b, name] for name in trainers} for b, trainers in by_batch.items()}


def _batch_entry(b, trainers, times: dict, examples: int) -> dict:
    """One batch size's medians (wall time), per-example times and ratios (printed as well), each
    contestant's wall and CPU time (:func:`timing`)."""
    stats = {name: timing(v) for name, v in times.items()}
    med = {name: t["median_wall_s"] for name, t in stats.items()}
    entry = {
        name: {
            "seconds_per_epoch": med[name],
            "us_per_example": 1e6 * med[name] / examples,
            "cpu_us_per_example": 1e6 * stats[name]["median_cpu_s"] / examples,
            "timing": stats[name],
        }
        for name in trainers
    }
    entry["torch"] = entry.get("torch")
    entry["sidejax_over_torch_time"] = med["sidejax"] / med["torch"] if "torch" in med else None
    if "kernel_only" in med:
        entry["kernel_only_over_sidejax_time"] = med["kernel_only"] / med["sidejax"]
        entry["kernel_only_over_no_banded_time"] = med["kernel_only"] / med["no_banded"]
        entry["no_banded_over_sidejax_time"] = med["no_banded"] / med["sidejax"]
    if "lax" in med:
        entry["lax_over_sidejax_time"] = med["lax"] / med["sidejax"]
    line = ", ".join(f"{k} {v['us_per_example']:.1f}" for k, v in entry.items() if isinstance(v, dict))
    print(f"batch {b}: us/example {line}", flush=True)
    cpu = ", ".join(
        f"{k} {v['timing']['cpu_over_wall']:.2f}" for k, v in entry.items() if isinstance(v, dict)
    )
    print(f"batch {b}: CPU / wall time {cpu}", flush=True)
    if entry["sidejax_over_torch_time"] is not None:
        print(f"batch {b}: sidejax / torch time {entry['sidejax_over_torch_time']:.2f}", flush=True)
    if "kernel_only_over_sidejax_time" in entry:
        print(
            f"batch {b}: speed-up over before issue 12 {entry['kernel_only_over_sidejax_time']:.2f}x"
            f" (input gradient {entry['kernel_only_over_no_banded_time']:.2f}x,"
            f" then banded matmul {entry['no_banded_over_sidejax_time']:.2f}x)"
        )
    return entry


def _run(args: argparse.Namespace) -> dict:
    load_before = load_average()
    torch = _setup_torch(args)
    data = _Data(args.examples)
    variants = ["sidejax"] + ["no_banded", "kernel_only"] * args.before + ["lax"] * args.lax
    by_batch = {}
    for b in args.batch_sizes:
        by_batch[b], params, spec = _sidejax_trainers(data, b, variants)
        if torch is not None:
            by_batch[b]["torch"] = _torch_trainer(torch, data, b, params, spec)
    all_times = _time_epochs(by_batch, args.repeats)
    per_batch = {
        str(b): _batch_entry(b, trainers, all_times[b], args.examples) for b, trainers in by_batch.items()
    }
    report = {
        "benchmark": "lenet5_local_training_vs_torch",
        "data": "fashion_mnist" if data.real else "random (fashion_mnist not installed)",
        "examples": args.examples,
        "batch_sizes": args.batch_sizes,
        "repeats": args.repeats,
        "threads": "1" if args.threads == 1 else "library defaults",
        "cores": args.cores,
        "optimizer": "sgd(lr=0.05, momentum=0.9)",
        "torch": None if torch is None else {"num_threads": torch.get_num_threads()},
        "machine": machine_record(load_before=load_before, torch=torch),
        "results": per_batch,
    }
    if "32" in per_batch and "128" in per_batch:
        both = [n for n, v in per_batch["32"].items() if isinstance(v, dict) and per_batch["128"].get(n)]
        for field, key in (("us_per_example", "time"), ("cpu_us_per_example", "cpu_time")):
            report[f"batch128_over_batch32_{key}_per_example"] = {
                name: per_batch["128"][name][field] / per_batch["32"][name][field] for name in both
            }
    write_report(report, args.output, trailing_newline=False)
    return report


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    return run_pinned("experiments.bench.torch_compare", args, argv, lambda: _run(args))


if __name__ == "__main__":
    main()
