"""Crash-safe, checksummed checkpoints of a :class:`sidejax.fl.RoundState` (Flax msgpack serialization).

A checkpoint is ONE file, ``<directory>/state.ckpt``, so it is one atomic unit: it is written in full to a
temporary file in the same directory, flushed and fsync'ed, then moved into place with :func:`os.replace`
(atomic on POSIX and Windows), and the directory entry is fsync'ed. An interrupt (Ctrl-C, a killed job, a
power cut) at any point leaves either the previous checkpoint or the new one, never a mix of the two. The
metadata (round index, the per-round metrics rows, wall time, target rounds) lives in the same file as the
state, so the two always describe the same round.

Layout (all of it is checked when loading)::

    sidejax-checkpoint v1\\n                     magic line
    {"sha256": ..., "meta_bytes": m, "state_bytes": s}\\n   header (JSON, one line)
    <m bytes of meta JSON><s bytes of Flax msgpack state>      payload

``sha256`` is the SHA-256 of the payload. A file whose magic line, header, payload length or checksum is
wrong (a flipped bit, a truncated copy, a partial download) is rejected with :class:`CheckpointError` naming
the file; a damaged checkpoint is never resumed.

Restoring needs a *target* state of the same structure (the freshly initialised one).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import serialization

__all__ = [
    "CHECKPOINT_FILE",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint_meta",
    "checkpoint_exists",
    "checkpoint_path",
]

CHECKPOINT_FILE = "state.ckpt"
_MAGIC = b"sidejax-checkpoint v1\n"
_LEGACY_FILES = ("state.msgpack", "state.json")


class CheckpointError(ValueError):
    """A checkpoint file is damaged (checksum, length or header wrong), of an unknown format, or does not
    match the run's state structure. The message names the file."""


def checkpoint_path(directory: str | Path) -> Path:
    """The checkpoint file of a checkpoint directory."""
    return Path(directory) / CHECKPOINT_FILE


def checkpoint_exists(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint file (damaged or not: loading checks it)."""
    d = Path(directory)
    return checkpoint_path(d).is_file() or any((d / f).is_file() for f in _LEGACY_FILES)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened; os.replace is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Writes ``data`` to a temporary file next to ``path`` and moves it into place in one step."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def save_checkpoint(directory: str | Path, state: Any, meta: dict[str, Any]) -> None:
    """Writes ``state`` (any pytree of arrays) and ``meta`` (JSON-serialisable) to ``directory/state.ckpt``
    as one atomic, checksummed file."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    host_state = jax.tree.map(np.asarray, jax.device_get(state))
    state_bytes = serialization.to_bytes(host_state)
    meta_bytes = json.dumps(meta).encode()
    payload = meta_bytes + state_bytes
    header = {
        "sha256": hashlib.sha256(payload).hexdigest(),
        "meta_bytes": len(meta_bytes),
        "state_bytes": len(state_bytes),
    }
    _atomic_write(checkpoint_path(d), _MAGIC + json.dumps(header).encode() + b"\n" + payload)


def _read_verified(directory: str | Path) -> tuple[Path, dict[str, Any], bytes]:
    """Reads and verifies the checkpoint file; returns ``(path, meta, state_bytes)``."""
    d = Path(directory)
    path = checkpoint_path(d)
    if not path.is_file():
        if any((d / f).is_file() for f in _LEGACY_FILES):
            raise CheckpointError(
                f"{d} holds a checkpoint in the old two-file format (state.msgpack + state.json), which "
                f"an interrupt can leave inconsistent and which has no checksum, so it is not resumed; start "
                f"the run again (--overwrite)"
            )
        raise FileNotFoundError(f"no checkpoint in {d} (expected {path})")
    data = path.read_bytes()
    bad = f"checkpoint {path} is damaged"
    if not data.startswith(_MAGIC):
        raise CheckpointError(
            f"{bad}: it does not start with {_MAGIC!r} (not a sidejax checkpoint or corrupt)"
        )
    end = data.find(b"\n", len(_MAGIC))
    try:
        if end < 0:
            raise ValueError("no header line")
        header = json.loads(data[len(_MAGIC) : end])
        digest, m, s = header["sha256"], int(header["meta_bytes"]), int(header["state_bytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{bad}: unreadable header ({e})") from None
    payload = data[end + 1 :]
    if len(payload) != m + s:
        raise CheckpointError(
            f"{bad}: the payload is {len(payload)} bytes, the header says {m + s} (truncated or extended)"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{bad}: SHA-256 checksum mismatch (corrupted bits); it cannot be resumed")
    try:
        meta = json.loads(payload[:m])
    except ValueError as e:  # only if the writer was wrong: the checksum matched
        raise CheckpointError(f"{bad}: unreadable metadata ({e})") from None
    return path, meta, payload[m:]


def read_checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """The verified metadata of the checkpoint in ``directory`` (the state is not decoded)."""
    return _read_verified(directory)[1]


def load_checkpoint(directory: str | Path, target: Any) -> tuple[Any, dict[str, Any]]:
    """Restores a state shaped like ``target``; returns ``(state, meta)``.

    Raises:
      FileNotFoundError: no checkpoint in ``directory``.
      CheckpointError: the file is damaged or does not match ``target``'s structure.
    """
    path, meta, state_bytes = _read_verified(directory)
    host_target = jax.tree.map(np.asarray, jax.device_get(target))
    try:
        state = serialization.from_bytes(host_target, state_bytes)
    except Exception as e:  # noqa: BLE001 - flax raises several types for a structure mismatch
        raise CheckpointError(
            f"checkpoint {path} does not match this run's state structure ({type(e).__name__}: {e})"
        ) from None
    want = jax.tree.map(lambda a: (np.shape(a), np.asarray(a).dtype), host_target)
    got = jax.tree.map(lambda a: (np.shape(a), np.asarray(a).dtype), state)
    if want != got:
        raise CheckpointError(f"checkpoint {path} does not match this run's state shapes/dtypes")
    return jax.tree.map(jax.numpy.asarray, state), meta
