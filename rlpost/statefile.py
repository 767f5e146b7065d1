"""State files (optimizer, scheduler, RNG and loop state) that load without running code.

A run directory may be shared (NFS, a ReadWriteMany volume), so whoever can write it
must not be able to execute code at ``--resume`` or at a guard's rollback. Every state
file rlpost reads back therefore loads with ``torch.load(weights_only=True)``: tensors,
numbers, strings and containers, plus the few record classes rlpost itself writes
(:data:`SAFE_TYPES`). A file holding anything else is refused in one line.

Writes are durable: the bytes are fsynced before the file is renamed into place and the
directory entry fsynced after, so a power loss leaves the old file or the new one. Every
file rlpost replaces whole goes through :func:`atomic_write`, whose temporary file is
created exclusively: whoever can write the directory cannot make rlpost write through a
link planted at the temporary name.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

SAFE_TYPES: list[type] = []
"""Classes a state file may hold besides plain data (rlpost's own records, added with
:func:`allow`)."""


class StateFileError(ValueError):
    """A state file that is missing, torn, or holds something rlpost does not write."""


def allow(*types: type) -> None:
    """Let state files hold instances of ``types`` (plain records whose fields are data)."""
    SAFE_TYPES.extend(t for t in types if t not in SAFE_TYPES)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (before renaming it into place)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(dirpath))


_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "wb", **open_args) -> Iterator[IO]:
    """Yield a file open on a new temporary file beside ``path``; when the block ends, fsync
    it and rename it onto ``path`` (durably); if the block raises, remove it.

    The temporary name is random and created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: no
    name planted in the directory beforehand (a symlink to elsewhere) is ever opened, and
    the rename replaces a link at ``path`` instead of writing through it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, _EXCLUSIVE, 0o666)
    try:
        with open(fd, mode, **open_args) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def clear(path: Path) -> None:
    """Remove whatever is at ``path``: a link itself (never what it points to), a file or
    a directory tree."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def fresh_dir(path: Path) -> Path:
    """``path`` as a new empty directory of this process's own (whatever was there removed;
    ``mkdir`` fails rather than follow a link planted after that)."""
    clear(path)
    path.mkdir(parents=True)
    return path


def save_state(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` atomically and durably."""
    with atomic_write(path) as fh:
        torch.save(obj, fh)


def load_state(path: Path) -> Any:
    """Read what :func:`save_state` wrote, never unpickling code.

    Raises :class:`StateFileError` (one line naming the file) for a missing or torn file and
    for one that holds a class rlpost does not write (a tampered file)."""
    path = Path(path)
    if not path.is_file():
        raise StateFileError(f"state file {path} is missing")
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        unsafe = _unsafe_globals(path)
        if unsafe:
            raise StateFileError(_refused(path, unsafe)) from None
        raise StateFileError(f"state file {path} cannot be read: {_first_line(exc)}") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise StateFileError(
            f"state file {path} is torn or unreadable: {_first_line(exc)}"
        ) from None


def check_state_file(path: Path) -> None:
    """Refuse (:class:`StateFileError`) a state file that is missing, not a whole archive, or
    holds a class rlpost does not write, without loading its tensors."""
    path = Path(path)
    if not path.is_file():
        raise StateFileError(f"state file {path} is missing")
    try:  # the archive's directory is written last: a torn file has none
        zipfile.ZipFile(path).close()
    except (zipfile.BadZipFile, OSError) as exc:
        raise StateFileError(
            f"state file {path} is torn or unreadable: {_first_line(exc)}"
        ) from None
    unsafe = _unsafe_globals(path)
    if unsafe:
        raise StateFileError(_refused(path, unsafe))


def _refused(path: Path, unsafe: list[str]) -> str:
    return (
        f"state file {path} refused: it holds {', '.join(unsafe[:3])}, which rlpost never "
        "writes (the file was altered or comes from elsewhere); restore it from a trusted copy"
    )


def _unsafe_globals(path: Path) -> list[str]:
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in SAFE_TYPES}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a file too broken to list: the caller reports it as unreadable
        return []
    return [g for g in found if g not in allowed]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
