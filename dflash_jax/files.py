"""Writing results safely: destinations checked before long work, atomic replaces, bounded waits.

A crash, a full disk or Ctrl-C during a write leaves either the old file or the new one, never
half of one, and an unwritable destination is refused before the minutes of work whose result
it was meant to hold.
"""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def check_writable(directory: str | Path, what: str) -> Path:
    """Creates `directory` (and parents) if needed and proves a file can be written in it.

    `what` names the argument in the error (e.g. "--out"). Tries a real file rather than
    `os.access`, which says yes to root on a read-only mount and to anyone on a full disk.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        # The message alone (no "[Errno N]" prefix): the CLI prints it as the error's one line.
        raise OSError(f"{what} {directory}: cannot write there ({err.strerror or err})") from None
    return directory


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Writes `data` to a temporary file beside `path`, then renames it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def bounded(fn: Callable[[], T], seconds: float, what: str) -> T:
    """Runs `fn` in a daemon thread and waits at most `seconds` for it.

    orbax's writers run in background threads that, after some failures, wait forever for a
    signal that never comes; the caller then gets a TimeoutError naming `what` instead of a
    process that never returns.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # handed to the waiting thread below
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True, name=f"bounded: {what}")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what}: no answer after {seconds:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def stuck_threads() -> list[str]:
    """Names of live non-daemon threads other than the main one (they would block the exit)."""
    main = threading.main_thread()
    return [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
