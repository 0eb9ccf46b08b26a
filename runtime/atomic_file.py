"""Crash-safe file writes: every file ringllm writes goes through `atomic_path`.

    with atomic_open("chat.session", "wb") as fh:     # or atomic_path(path) -> a temporary path to fill
        fh.write(data)

Protocol (SQLite's and git's): the new content goes to a temporary file in the same folder
(`.NAME.PID-RANDOM.tmp`, so a rename never crosses file systems), which is fsynced, renamed over the
old file (atomic on POSIX), and then the folder is fsynced so the rename itself survives a power
cut. A reader therefore sees the old file or the new one, never half of one, whatever moment the
writer dies at. A writer killed before the rename leaves its temporary behind; the next write of the
same file removes every temporary whose writer process no longer exists (a live writer's is left
alone, so two processes may save the same file concurrently: the last rename wins).

An OSError while writing (disk full, file size limit, permissions) removes the temporary, leaves the
old file as it was, and propagates; callers turn it into their own RingLLMError naming the file.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from typing import IO, Iterator

__all__ = ["atomic_path", "atomic_open", "write_bytes", "stale_temporaries", "pid_alive"]


def _temp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}."


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs. A zombie (ended, not yet reaped by its parent) does not, where
    /proc says so. Outside POSIX the answer is always True: there os.kill(pid, 0) would terminate the
    process rather than probe it, so nothing is taken for dead."""
    if os.name != "posix":
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # exists, owned by someone else
        return True
    return True


def stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Temporaries of `path` left by writers that no longer run (full paths)."""
    path = os.path.abspath(os.fspath(path))
    folder, prefix = os.path.dirname(path), _temp_prefix(path)
    out = []
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_part = name[len(prefix):-4].split("-", 1)[0]
        if pid_part.isdigit() and not pid_alive(int(pid_part)):
            out.append(os.path.join(folder, name))
    return out


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:                  # platforms without directory handles (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass                         # some file systems refuse fsync on a directory; the rename stands
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path next to `path`; when the block ends normally the file written there
    is fsynced and renamed over `path`, and the folder fsynced. On any exception the temporary is
    removed and `path` is untouched. Stale temporaries of killed writers are removed first."""
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    for stale in stale_temporaries(path):
        with contextlib.suppress(OSError):
            os.unlink(stale)
    tmp = os.path.join(folder, f"{_temp_prefix(path)}{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """`open(path, mode)` that replaces `path` crash-safely when the block ends (see atomic_path).
    mode is "wb" or "w" (then encoding defaults to UTF-8)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes whole files: mode 'wb' or 'w', not {mode!r}")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()


def write_bytes(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace `path` with `data` (str is written as UTF-8), crash-safely."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_open(path, "wb") as fh:
        fh.write(data)
