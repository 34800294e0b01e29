"""Where shard index files live and how they are written: one compressed ``.npz`` per shard in
the cache directory (local or any fsspec URL), replaced atomically, built under a lock.

The lock is ``fcntl.flock`` on ``<index file>.lock``: the first process to need an index builds
it while the others wait, then load it (tested with racing processes). A remote cache directory
(``s3://bucket/index/``) is read and written without a lock (object stores replace objects
atomically); build it ahead with ``streampack index``. A cache that cannot be written is
warned about (rate-limited) and the index is used uncached: building may then happen again,
never wrongly.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
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
    name = hashlib.sha1(url.encode()).hexdigest()[:16] + "-" + name + INDEX_SUFFIX
    return f"{directory.rstrip('/')}/{name}" if is_remote(directory) else os.path.join(directory, name)


def load_arrays(path: str, opts: OpenOptions) -> dict[str, np.ndarray] | None:
    """The arrays stored at ``path``; None when absent or unreadable (then it is rebuilt)."""
    try:
        if is_remote(path):
            fs, p = storage.filesystem(path, opts)
            raw: Any = io.BytesIO(fs.cat_file(p))
        else:
            raw = open(path, "rb")  # noqa: SIM115 - closed below
        with raw, np.load(raw, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, KeyError, EOFError):
        return None


def save_arrays(path: str, arrays: dict[str, np.ndarray], opts: OpenOptions) -> bool:
    """Write ``arrays`` to ``path`` atomically; False (with a warning) when it cannot."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = None
    try:
        if is_remote(path):
            fs, p = storage.filesystem(path, opts)
            fs.pipe_file(p, buf.getvalue())
            return True
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".spidx-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getvalue())
        os.replace(tmp, path)
        return True
    except Exception as e:  # noqa: BLE001 - any store error: the index still works uncached
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        warn_every(log, "index-not-cached", "cannot cache a shard index at %s: %s", path, e)
        return False


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """An exclusive lock beside a local index file (none for a remote cache, or when the
    directory is not writable)."""
    if is_remote(path):
        yield
        return
    try:
        import fcntl

        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path + ".lock", "a+b")  # noqa: SIM115 - held for the with-block
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


__all__ = ["INDEX_SUFFIX", "cache_path", "default_cache_dir", "index_dir", "load_arrays", "locked", "save_arrays"]
