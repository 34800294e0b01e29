"""Where shard index files live and how they are written: one compressed ``.npz`` per shard in
the cache directory (local or any fsspec URL), replaced atomically, built under a lock.

The lock is ``fcntl.flock`` on ``<index file>.lock``; a remote cache directory is used without one (objects are replaced
atomically). A local directory that cannot be written is said once per process and the index used uncached; a filesystem
without ``flock`` builds without the lock. Files are created ``0666 & ~umask``, so a team can share a cache.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import secrets
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from streampack.io import storage
from streampack.io.storage import OpenOptions, is_remote
from streampack.logs import get_logger, warn_every

INDEX_SUFFIX = ".spidx.npz"
log = get_logger(__name__)


def default_cache_dir() -> str:
    return os.environ.get("STREAMPACK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "streampack")


def index_dir(cache_dir: str | None) -> str:
    """Where index files go: ``cache_dir``, else ``<default cache>/index``."""
    return cache_dir if cache_dir is not None else os.path.join(default_cache_dir(), "index")


def cache_path(url: str, cache_dir: str | None) -> str:
    """The index file of ``url`` (named by a hash of the URL and its basename)."""
    name = os.path.basename(url.split("?", 1)[0].rstrip("/")) or "shard"
    directory = index_dir(cache_dir)
    return join_path(directory, hashlib.sha1(url.encode()).hexdigest()[:16] + "-" + name + INDEX_SUFFIX)


def join_path(location: str, name: str) -> str:
    """``location/name`` for a local directory or a store URL."""
    return f"{location.rstrip('/')}/{name}" if is_remote(location) else os.path.join(location, name)


class DamagedFile(ValueError):
    """A file that is there but is not a readable ``.npz`` (cut short, corrupt, another format).
    Its message names the path and the decoder's complaint, never the file's bytes."""


# What numpy's and zipfile's readers raise on bytes that are not a whole .npz: a cut file is a
# BadZipFile (no central directory) or an EOFError / zlib.error inside a member.
_DAMAGE = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, KeyError, struct.error, NotImplementedError)


def read_arrays(path: str, opts: OpenOptions) -> dict[str, np.ndarray] | None:
    """The arrays stored at ``path``; None when there is no file, :class:`DamagedFile` when it is not a
    readable ``.npz``."""
    try:
        if is_remote(path):
            fs, p = storage.filesystem(path, opts)
            raw: Any = io.BytesIO(fs.cat_file(p))
        else:
            raw = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return None
    try:
        with raw, zipfile.ZipFile(raw, **_NAMES) as archive:
            return {name.removesuffix(".npy"): np.lib.format.read_array(archive.open(name), allow_pickle=False)
                    for name in archive.namelist()}
    except _DAMAGE as e:
        raise DamagedFile(f"{path!r} is not a readable .npz ({type(e).__name__}: {str(e)[:80]})") from None


# Member names are read as UTF-8 (``np.savez`` writes ASCII names: the same strings): zipfile's default
# cp437 codec would be imported on first use in every process, each DataLoader worker included (3.10 has
# no such option).
_NAMES: dict[str, str] = {"metadata_encoding": "utf-8"} if sys.version_info >= (3, 11) else {}


def load_arrays(path: str, opts: OpenOptions) -> dict[str, np.ndarray] | None:
    """The arrays stored at ``path``; None when absent or unreadable (then it is rebuilt)."""
    try:
        return read_arrays(path, opts)
    except (OSError, DamagedFile):
        return None


def save_arrays(path: str, arrays: dict[str, np.ndarray], opts: OpenOptions) -> bool:
    """Write ``arrays`` to ``path`` atomically (local: a temporary file renamed over it, ``0666 & ~umask``;
    object stores: one PUT); False when it cannot (an unwritable local directory is said once)."""
    directory = os.path.dirname(path)
    if not is_remote(path) and directory in _unwritable:
        return False
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = None
    try:
        if is_remote(path):
            fs, p = storage.filesystem(path, opts)
            fs.pipe_file(p, buf.getvalue())
            return True
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".spidx-{os.getpid()}-{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mkstemp's 0600 shut the team out
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getvalue())
        os.replace(tmp, path)
        return True
    except Exception as e:  # noqa: BLE001 - any store error: the index still works uncached
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, PermissionError) or getattr(e, "errno", None) == errno.EROFS:
            _read_only(directory, e)
        else:
            warn_every(log, "index-not-cached", "cannot cache a shard index at %s: %s", path, e)
        return False


_unwritable: set[str] = set()  # local directories found read-only: not written again


def _read_only(directory: str, e: BaseException) -> None:
    if directory not in _unwritable:
        _unwritable.add(directory)
        _unlockable.add(directory)
        log.warning("the index cache %s cannot be written (%s): a shard index missing there is built in memory by "
                    "every process that needs it (one scan of the shard each). Build them once with "
                    "`streampack index URLS --cache-dir %s`, or pass a writable cache_dir", directory, e, directory)


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """An exclusive lock beside a local index file; none for a remote cache, an unwritable directory or a
    filesystem without ``flock`` (said once): two processes may then build the same index, never a wrong one."""
    directory = os.path.dirname(path)
    if is_remote(path) or directory in _unlockable:
        yield
        return
    try:
        import fcntl

        os.makedirs(directory, exist_ok=True)
        f = open(path + ".lock", "a+b")  # noqa: SIM115 - held for the with-block
    except (ImportError, OSError) as e:
        if isinstance(e, PermissionError) or getattr(e, "errno", None) == errno.EROFS:
            _read_only(directory, e)
        else:
            _no_lock(directory, e)
        yield
        return
    with f:
        held = True
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError as e:
            held = False
            _no_lock(directory, e)
        try:
            yield
        finally:
            if held:
                with contextlib.suppress(OSError):
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)


_unlockable: set[str] = set()  # directories where locking failed once: not tried again


def _no_lock(directory: str, e: BaseException) -> None:
    if directory not in _unlockable:
        _unlockable.add(directory)
        log.warning("cannot lock index files in %s (%s): indexes are built without a lock there (two processes may "
                    "build the same one; never a wrong one). Build them ahead with `streampack index`", directory,
                    e)


__all__ = ["INDEX_SUFFIX", "DamagedFile", "cache_path", "default_cache_dir", "index_dir", "join_path", "load_arrays",
           "locked", "read_arrays", "save_arrays"]
