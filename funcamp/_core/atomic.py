"""Atomic file writes, and the removal of what crashed writes left behind (standard library only).

:func:`atomic_write` writes ``path`` through a temporary file in the same directory. The file is
written, flushed, ``fsync``-ed and renamed over ``path`` (``os.replace``: atomic on POSIX and
Windows). Then the directory is ``fsync``-ed. Whatever happens, ``path`` holds either its previous
contents or the new ones, never a mixture. That holds for an exception, a full disk, a ``SIGKILL``
or a power cut.

An exception removes the temporary file; a killed process cannot. So every temporary file names its
writer, ``.<name>.<host>.<pid>.<16 hex digits>.tmp``. Its writer holds an exclusive ``flock`` on it
while it writes. A temporary name is never longer than :data:`NAME_MAX` bytes: when the name is too
long, ``<name>`` is ``~`` and 16 hex digits of its hash. Before writing, :func:`atomic_write`
removes the temporary files of earlier writes to the same ``path`` whose writer is gone
(:func:`remove_debris`). So a job that is killed and restarted again and again does not fill its
disk. A file is removed only if its name has exactly that form for this ``path`` and

* nobody holds its lock (the kernel drops a dead process's locks; a live writer holds it), and
* its writer is known to be gone. On this host (same host name), no process with its pid is
  running. Elsewhere (another host on a shared file system, or a pid now used by another
  process), it has not been modified for :data:`STALE_S` seconds.

Where the file system cannot lock (``flock`` fails), only the same-host case of the second rule
is used. Files of other hosts are then left alone. On Windows nothing is
removed (no ``flock``; its own file sharing rules keep an open file). Files written by older
funcamp versions (``.<name>.<random>.tmp``, without a writer in the name) are never removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["STALE_S", "atomic_write", "remove_debris", "temp_name"]

#: Seconds without a modification after which an unlocked temporary file whose writer cannot be
#: checked (another host, or a pid reused) counts as left behind.
STALE_S = 60.0

_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


#: The longest file name (in bytes) most file systems take (``NAME_MAX``).
NAME_MAX = 255

# What temp_name adds around the name: ".", ".<host>.<pid>.<16 hex digits>.tmp".
_EXTRA = 1 + 1 + 32 + 1 + 20 + 1 + 16 + 4


def _stem(name: str) -> str:
    """The part of a temporary file's name that stands for ``name``: ``name`` itself, or, when
    the temporary name would then be longer than :data:`NAME_MAX` bytes, ``~`` and 16 hex
    digits of its SHA-256 (so a temporary name is never longer than the name allows)."""
    if len(os.fsencode(name)) + _EXTRA <= NAME_MAX:
        return name
    return "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:16]


def temp_name(name: str) -> str:
    """The name of a fresh temporary file for writing ``name``.

    It names this host and process. It is at most :data:`NAME_MAX` bytes long (a long ``name``
    is replaced by its hash).
    """
    return f".{_stem(name)}.{_HOST}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(_stem(name))}\.([A-Za-z0-9-]+)\.(\d+)\.[0-9a-f]{{16}}\.tmp")


def _running(pid: int) -> bool:
    """Whether a process with this pid runs on this host (in this pid namespace)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or a pid we cannot check): alive
    return True


def _lock(fd: int) -> bool | None:
    """Try to take an exclusive lock without waiting: True (taken), False (someone holds it),
    None (this file system cannot lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _left_behind(path: str, host: str, pid: int) -> bool:
    """Remove ``path`` if its writer is gone (see the module docstring); whether it did."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # already gone (renamed by its writer, removed by another cleaner)
        return False
    try:
        locked = _lock(fd)
        if locked is False:
            return False  # a live writer holds it
        gone = host == _HOST and not _running(pid)
        if not gone and locked:
            gone = time.time() - os.fstat(fd).st_mtime > STALE_S
        if gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return gone
    finally:
        os.close(fd)


def remove_debris(path: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary files that crashed :func:`atomic_write` calls for ``path`` left.

    Only those are removed, and only when their writer is gone (see the module docstring).

    Returns:
        The names of the files removed.
    """
    if fcntl is None:  # pragma: no cover - Windows
        return []
    p = Path(path)
    pattern = _pattern(p.name)
    prefix = f".{_stem(p.name)}."
    removed = []
    try:
        entries = list(os.scandir(p.parent))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        match = pattern.fullmatch(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        if _left_behind(entry.path, match[1], int(match[2])):
            removed.append(entry.name)
    return removed


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """``fsync`` a directory, so a rename in it survives a power cut (a no-op on Windows)."""
    if os.name != "posix":  # pragma: no cover - Windows cannot open a directory to fsync it
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically.

    ``write(f)`` fills a temporary file in its directory, which is ``fsync``-ed and renamed over
    ``path``. Then the directory is ``fsync``-ed. On any failure (an exception,
    ``KeyboardInterrupt``) the temporary file is removed and ``path`` is untouched. A failure of
    the file system (a full disk, a read-only directory) raises ``OSError`` with its ``errno``,
    naming ``path``. It does so even where ``write`` wrapped it in another exception
    (``torch.save`` raises ``RuntimeError``). The temporary files that killed writers left for
    ``path`` are removed first (:func:`remove_debris`). The file gets the usual permissions
    (``0o666`` less the umask).
    """
    p = Path(path)
    remove_debris(p)
    tmp = p.parent / temp_name(p.name)
    # os.open with 0o666 (the umask applies), so the file gets the usual permissions.
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:  # a read-only directory, ...: name the caller's path, not ours
        raise OSError(
            e.errno, f"{e.strerror} (creating a temporary file next to it)", str(p)
        ) from e
    try:
        with os.fdopen(fd, "wb") as f:
            if fcntl is not None:
                with contextlib.suppress(OSError):  # a file system that cannot lock
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # held until closed
            write(f)
            f.flush()
            os.fsync(f.fileno())
            if os.name == "posix":  # renamed while locked: no cleaner ever finds it unlocked
                os.replace(tmp, p)
        if os.name != "posix":  # pragma: no cover - Windows renames only a closed file
            os.replace(tmp, p)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        error = _os_error(e) if isinstance(e, Exception) else None
        if error is None:
            raise
        raise OSError(
            error.errno,
            f"{error.strerror or error} (while writing it; what was at this path is kept)",
            str(p),
        ) from e
    fsync_dir(p.parent)


def _os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` of a failed write, found in ``e``'s chain (``torch.save`` raises a
    ``RuntimeError`` with the file's ``OSError`` as its context), or None."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None
