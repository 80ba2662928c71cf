"""Ctrl-C for the command line: a clean stop with exit status 130, whenever it comes.

Python runs a signal handler only between bytecodes of the main thread, and a compiled JAX call (a chunk of
rounds, a compilation) can hold the main thread for minutes: a ``KeyboardInterrupt`` then arrives only when
the call returns, and ending the interpreter while XLA work is in flight crashed it (exit status 139). So
while :func:`handle_ctrl_c` is active, SIGINT is read by a watcher thread (``signal.set_wakeup_fd``), which
runs while the main thread waits in XLA:

- the first Ctrl-C inside :func:`deferring` (the round loop) asks the loop to stop at its next safe point:
  the loop calls :func:`stop_point` once a chunk's (or a part of a round's) checkpoint is written, which
  raises :class:`Interrupted`. The watcher says so at once, and that a second Ctrl-C quits now;
- a second Ctrl-C, or the first one outside the round loop, quits now: once no write is in progress
  (:func:`writing`, around every file the driver writes, so no file is left half-written), the watcher
  prints what ``on_quit`` says (the resume command of the last checkpoint) and ends the process with
  ``os._exit(130)``, without the interpreter teardown.

Without :func:`handle_ctrl_c` (a notebook, a test calling the driver), Ctrl-C raises ``KeyboardInterrupt`` as
usual and the other functions do nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = [
    "Interrupted",
    "handle_ctrl_c",
    "deferring",
    "writing",
    "stop_point",
    "exit_process",
    "flush_output",
]

#: the exit status of a run stopped by Ctrl-C (128 + SIGINT)
INTERRUPTED = 130


class Interrupted(KeyboardInterrupt):
    """Raised by :func:`stop_point` after a Ctrl-C, at a safe point: the last checkpoint is written."""


class _Handler:
    def __init__(self, on_quit: Callable[[], object]) -> None:
        self.on_quit = on_quit
        self.lock = threading.RLock()  # held while files are written, and by the watcher when it quits
        self.stop = threading.Event()
        self.deferring = 0
        self.presses = 0
        self.reported = False

    def report(self) -> int:
        """Prints ``on_quit``'s message once (the watcher and the main thread may both get here); returns the
        exit status, 130."""
        with self.lock:
            if not self.reported:
                self.reported = True
                self.on_quit()
            flush_output()
        return INTERRUPTED

    def pressed(self) -> None:
        self.presses += 1
        if self.presses == 1 and self.deferring:
            self.stop.set()
            print(
                "\nCtrl-C: the run stops at the end of the current step, once its checkpoint is written (a "
                "long compiled step may take a while). Press Ctrl-C again to quit now, from the last "
                "checkpoint written.",
                file=sys.stderr,
            )
            flush_output()
            return
        with self.lock:  # waits for a write in progress to end; the main thread never gets it back
            self.report()
            os._exit(INTERRUPTED)

    def watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            for _ in range(data.count(signal.SIGINT)):
                self.pressed()


_ACTIVE: _Handler | None = None


def flush_output() -> None:
    """Flushes stdout and stderr, ignoring a stream that cannot be (before an ``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def handle_ctrl_c(on_quit: Callable[[], object]) -> Iterator[_Handler | None]:
    """Within it, Ctrl-C is handled as the module docstring says; ``on_quit()`` prints where the run stopped
    and how to continue it (called once, by the watcher thread or by :meth:`report`). Outside the main
    thread (where signals cannot be handled) it does nothing and yields ``None``."""
    global _ACTIVE
    if threading.current_thread() is not threading.main_thread() or _ACTIVE is not None:
        yield None
        return
    handler = _Handler(on_quit)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    old_handler = signal.signal(signal.SIGINT, lambda signum, frame: None)  # the watcher acts
    watcher = threading.Thread(target=handler.watch, args=(read_fd,), name="ctrl-c", daemon=True)
    watcher.start()
    _ACTIVE = handler
    try:
        yield handler
    finally:
        _ACTIVE = None
        signal.signal(signal.SIGINT, old_handler)
        signal.set_wakeup_fd(old_fd)
        os.close(write_fd)
        watcher.join()
        os.close(read_fd)


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """The round loop: a first Ctrl-C within it stops the run at the next :func:`stop_point`."""
    handler = _ACTIVE
    if handler is None:
        yield
        return
    handler.deferring += 1
    try:
        yield
    finally:
        handler.deferring -= 1


def writing() -> contextlib.AbstractContextManager:
    """Files being written (``with writing(): ...``): a Ctrl-C that quits waits until the block ends."""
    return contextlib.nullcontext() if _ACTIVE is None else _ACTIVE.lock


def stop_point() -> None:
    """A safe point of the round loop (its checkpoint written): raises :class:`Interrupted` if a Ctrl-C
    asked the run to stop."""
    if _ACTIVE is not None and _ACTIVE.stop.is_set():
        raise Interrupted


def exit_process(status: int) -> None:
    """Ends a command with ``status``; after a Ctrl-C (130) without the interpreter's teardown, which can
    crash while XLA threads still run (the output is flushed first)."""
    if status == INTERRUPTED:
        flush_output()
        os._exit(status)
    sys.exit(status)
