"""Dataset loaders returning host numpy arrays in one common format.

Every loader returns a :class:`Dataset` ``(x, y, num_classes)``:

* images are NHWC ``float32`` in ``[0, 1]``, labels are ``int32`` in ``[0, num_classes)``;
* tabular inputs are ``float32`` ``[N, D]``;
* regression targets are ``float32`` with ``num_classes == 0``.

Small datasets (``digits``, ``moons``, the synthetic ones) are generated or bundled with scikit-learn and
need no files. The image datasets (``mnist``, ``fashion_mnist``, ``emnist``, ``cifar10``, ``cifar100``) are
read from their original file formats (IDX for the MNIST family, the python pickle batches for CIFAR),
searched for in, in order:

1. the ``data_dir`` argument, if given;
2. ``$SIDEJAX_DATA_DIR/<name>`` and ``$SIDEJAX_DATA_DIR``;
3. ``~/.cache/sidejax/<name>``;
4. ``/usr/share/datasets/<name with "_" replaced by "-">`` (where Debian's ``dataset-fashion-mnist``
   package installs Fashion-MNIST).

If none of these holds the files and ``tensorflow_datasets`` is installed, the data is loaded through
TFDS (``download=True`` lets TFDS fetch it); otherwise a :class:`FileNotFoundError` explains where the
files were looked for and how to obtain them. Nothing is cached in memory between calls.

This module holds the registry (:data:`DATASETS`, each dataset's keyword arguments), the search path and
:func:`load_dataset`; the formats are read by :mod:`sidejax.data.idx` (MNIST family),
:mod:`sidejax.data.cifar` (CIFAR batches), :mod:`sidejax.data.builtin` (datasets that need no files) and
:mod:`sidejax.data.tfds` (the TFDS fallback), all returning the common :class:`Dataset`
(:mod:`sidejax.data.base`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sidejax.data import tfds as tfds_loader
from sidejax.data.base import SPLITS, Dataset, check_split
from sidejax.data.builtin import load_digits, load_moons, synthetic_regression
from sidejax.data.cifar import CIFAR_FOLDERS, cifar_file_names, load_cifar_files
from sidejax.data.idx import EMNIST_SUBSETS, IDX_DATASETS, idx_file_names, load_idx_pair, mnist_like, read_idx

__all__ = [
    "DATASETS",
    "DEBIAN_DATA_ROOT",
    "EMNIST_SUBSETS",
    "Dataset",
    "dataset_available",
    "load_dataset",
    "read_idx",
    "synthetic_regression",
]

#: Root of Debian's dataset packages (``apt-get install dataset-fashion-mnist``). Module-level so tests
#: can point it elsewhere.
DEBIAN_DATA_ROOT = "/usr/share/datasets"

_FILE_DATASETS = (*IDX_DATASETS, *CIFAR_FOLDERS)

# Allowed keyword arguments of ``load_dataset`` per dataset, with defaults; its keys, in order, are DATASETS.
_DATASET_KWARGS: dict[str, dict[str, Any]] = {
    "digits": {},
    "moons": {"num_samples": 1000, "noise": 0.14, "seed": 0},
    "synthetic_linear": {"num_samples": 1000, "dim": 10, "noise": 0.1, "seed": 0},
    "synthetic_logistic": {"num_samples": 1000, "dim": 10, "noise": 0.1, "seed": 0},
    "mnist": {},
    "fashion_mnist": {},
    "emnist": {"subset": "balanced"},
    "cifar10": {},
    "cifar100": {},
}

#: Every name :func:`load_dataset` accepts: the built-in datasets, then the file-based ones.
DATASETS: tuple[str, ...] = tuple(_DATASET_KWARGS)


# --------------------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"name must be one of {', '.join(DATASETS)}; got {name!r}.")


def _resolve_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    allowed = _DATASET_KWARGS[name]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        valid = ", ".join(sorted(allowed)) if allowed else "none"
        raise ValueError(
            f"Unknown keyword argument(s) {', '.join(unknown)} for dataset {name!r}; valid keyword "
            f"arguments: {valid}."
        )
    return {**allowed, **kwargs}


def _check_subset(subset: Any) -> str:
    if subset not in EMNIST_SUBSETS:
        raise ValueError(f"subset must be one of {', '.join(EMNIST_SUBSETS)}; got {subset!r}.")
    return subset


# --------------------------------------------------------------------------------------------------
# Search path and lookup
# --------------------------------------------------------------------------------------------------


def _search_dirs(name: str, data_dir: str | os.PathLike | None) -> list[str]:
    """Directories searched for a file-based dataset, in priority order."""
    dirs: list[str] = []
    if data_dir is not None:
        dirs.append(os.fspath(data_dir))
    env = os.environ.get("SIDEJAX_DATA_DIR")
    if env:
        dirs.extend([os.path.join(env, name), env])
    dirs.append(os.path.join(os.path.expanduser("~"), ".cache", "sidejax", name))
    dirs.append(os.path.join(DEBIAN_DATA_ROOT, name.replace("_", "-")))
    return dirs


def _expected_files(name: str, splits: Sequence[str], subset: str) -> list[str]:
    """Human-readable list of the files a dataset needs (for error messages)."""
    if name in IDX_DATASETS:
        return [f"{base}[.gz]" for split in splits for base in idx_file_names(name, split, subset)]
    folder = CIFAR_FOLDERS[name]
    return [f"{folder}/{f}" for split in SPLITS if split in splits for f in cifar_file_names(name, split)]


def _find_in_dir(directory: str, base: str) -> str | None:
    for candidate in (os.path.join(directory, base), os.path.join(directory, base + ".gz")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _locate_idx(name: str, split: str, subset: str, dirs: Sequence[str]) -> tuple[str, str] | None:
    img_base, lbl_base = idx_file_names(name, split, subset)
    for d in dirs:
        img, lbl = _find_in_dir(d, img_base), _find_in_dir(d, lbl_base)
        if img is not None and lbl is not None:
            return img, lbl
    return None


def _locate_cifar(name: str, split: str, dirs: Sequence[str]) -> list[str] | None:
    folder = CIFAR_FOLDERS[name]
    files = cifar_file_names(name, split)
    for d in dirs:
        # Accept both the directory containing the extracted folder and the folder itself.
        for root in (os.path.join(d, folder), d):
            paths = [os.path.join(root, f) for f in files]
            if all(os.path.isfile(p) for p in paths):
                return paths
    return None


def _locate(name: str, split: str, subset: str, dirs: Sequence[str]) -> Any:
    if name in IDX_DATASETS:
        return _locate_idx(name, split, subset, dirs)
    return _locate_cifar(name, split, dirs)


def dataset_available(
    name: str, *, data_dir: str | os.PathLike | None = None, subset: str = "balanced"
) -> bool:
    """Whether ``load_dataset(name)`` can run from local data alone (without TFDS or a download).

    Generated and scikit-learn-bundled datasets are always available; file-based datasets are available
    when both their train and test files are found on the search path (see the module docstring).

    Args:
        name: One of :data:`DATASETS`.
        data_dir: Optional directory searched first, as in :func:`load_dataset`.
        subset: EMNIST subset checked when ``name == "emnist"`` (ignored otherwise).

    Returns:
        ``True`` if the dataset can be loaded from local files (or needs none).

    Raises:
        ValueError: If ``name`` or ``subset`` is invalid.
    """
    _check_name(name)
    if name not in _FILE_DATASETS:
        return True
    subset = _check_subset(subset) if name == "emnist" else subset
    dirs = _search_dirs(name, data_dir)
    return all(_locate(name, split, subset, dirs) is not None for split in SPLITS)


def _not_found(name: str, split: str, subset: str, dirs: Sequence[str]) -> FileNotFoundError:
    files = _expected_files(name, [split], subset)
    what = f"dataset {name!r}" + (f" (subset {subset!r})" if name == "emnist" else "")
    lines = [
        f"Could not find the {split!r} split of {what}.",
        "Looked in:",
        *(f"  {d}" for d in dirs),
        "Expected files (in one of these directories):",
        *(f"  {f}" for f in files),
        "To get them:",
        "  * put the files in a directory and set SIDEJAX_DATA_DIR to it (or to its parent, with a "
        f"'{name}' subfolder), or pass data_dir=...;",
    ]
    if name == "fashion_mnist":
        lines.append(
            f"  * on Debian/Ubuntu: apt-get install dataset-fashion-mnist (installs to "
            f"{os.path.join(DEBIAN_DATA_ROOT, 'fashion-mnist')});"
        )
    lines.append(
        "  * or pip install sidejax[tfds] and call load_dataset(..., download=True) to fetch it via "
        "tensorflow_datasets."
    )
    return FileNotFoundError("\n".join(lines))


# --------------------------------------------------------------------------------------------------
# Public loader
# --------------------------------------------------------------------------------------------------


def load_dataset(
    name: str,
    split: str = "train",
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    **kwargs: Any,
) -> Dataset:
    """Loads one split of a dataset as host numpy arrays.

    Args:
        name: One of :data:`DATASETS`.
        split: ``"train"`` or ``"test"``. ``digits`` uses a fixed 80/20 split (1437/360) of the 1797
            scikit-learn images; ``moons`` and the synthetic datasets draw independent test samples.
        data_dir: Directory searched first for file-based datasets (see the module docstring for the
            full search order). Ignored by generated datasets.
        download: Passed to ``tensorflow_datasets.load`` when the files are not found locally and TFDS
            is installed.
        **kwargs: Dataset-specific options:
            ``moons``: ``num_samples=1000``, ``noise=0.14``, ``seed=0``;
            ``synthetic_linear`` / ``synthetic_logistic``: ``num_samples=1000``, ``dim=10``,
            ``noise=0.1``, ``seed=0``;
            ``emnist``: ``subset="balanced"`` (one of :data:`EMNIST_SUBSETS`).

    Returns:
        A :class:`Dataset`. Images are NHWC ``float32`` in ``[0, 1]`` (MNIST family ``[N, 28, 28, 1]``,
        CIFAR ``[N, 32, 32, 3]``, digits ``[N, 8, 8, 1]``); labels ``int32``.

    Raises:
        ValueError: For an unknown ``name``, an invalid ``split``, an unknown or invalid keyword
            argument, or corrupt data files.
        FileNotFoundError: If a file-based dataset is not found locally and ``tensorflow_datasets`` is
            not installed; the message lists the directories searched, the expected file names and how
            to obtain them.
    """
    _check_name(name)
    check_split(split)
    if not isinstance(download, bool):
        raise ValueError(f"download must be a bool; got {download!r}.")
    opts = _resolve_kwargs(name, kwargs)

    if name == "digits":
        return load_digits(split)
    if name == "moons":
        return load_moons(split, opts["num_samples"], opts["noise"], opts["seed"])
    if name in ("synthetic_linear", "synthetic_logistic"):
        return synthetic_regression(
            opts["num_samples"],
            opts["dim"],
            kind="linear" if name == "synthetic_linear" else "logistic",
            noise=opts["noise"],
            seed=opts["seed"],
            split=split,
        )

    subset = _check_subset(opts["subset"]) if name == "emnist" else ""
    dirs = _search_dirs(name, data_dir)
    found = _locate(name, split, subset, dirs)
    if found is not None:
        if name in IDX_DATASETS:
            images, labels = load_idx_pair(*found)
            return mnist_like(name, subset, images, labels)
        return load_cifar_files(name, found)
    if tfds_loader.tfds_installed():
        return tfds_loader.load_tfds(name, split, subset, download)
    raise _not_found(name, split, subset, dirs)
