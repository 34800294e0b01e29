"""Opening a shard at a byte offset: the only place that reads bytes from a file or a store (docs/storage.md).

A :class:`ResumableStream` retries a failed read or a short body *at its current offset*, so the parser never sees a
retry, a duplicate or a gap. Remote URLs are read in blocks of ``OpenOptions.block_size``, one bounded request each, the
next prefetched in a thread: unlike one streaming GET, every request gets a deadline and the same retry rules, and
parsing (90-160 MB/s a worker) stays the bottleneck (``benchmarks/bench_storage.py``).
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from typing import Any, BinaryIO

from streampack.errors import DataError
from streampack.io.failures import classify
from streampack.io.http import Pin, get_range, s3_get_range
from streampack.io.retry import IOStats, Transient, with_retries
from streampack.io.storage import OpenOptions, deadline, filesystem, is_http, is_remote, local_path, protocol_of, stat

_DISCARD_CHUNK = 1 << 20
BUFFER = 256 << 10
"""The buffered reader's buffer, and the bytes of a local read."""


def _open_local(path: str) -> BinaryIO:
    """Indirection point so tests can count the bytes a reader touches (or inject faults)."""
    return open(path, "rb")


class _Local:
    """A local file, reopened after a fault."""

    def __init__(self, path: str) -> None:
        self.path, self.size = path, None  # a local file ends where its reads end
        self._f: BinaryIO | None = None
        self._at = -1
        try:
            self._file()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
            raise DataError("missing_shard", f"cannot open: {e.strerror or e}", url=path, value=path) from None

    def _file(self) -> BinaryIO:
        if self._f is None:
            self._f, self._at = _open_local(self.path), 0
        return self._f

    def fetch(self, start: int, end: int) -> bytes:
        f = self._file()
        if self._at != start:
            f.seek(start)
        data = f.read(end - start)
        self._at = start + len(data)
        return data

    def length(self) -> int | None:
        """The file's current size (parquet readers seek from the end)."""
        self._at = self._file().seek(0, io.SEEK_END)
        return self._at

    def close(self) -> None:
        """Also what a fault does: the next fetch reopens the file."""
        f, self._f, self._at = self._f, None, -1
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


class _Remote:
    """One object of an fsspec filesystem, read by ranged requests (http(s): one version of it,
    never more bytes than asked; see :mod:`streampack.io.http`)."""

    def __init__(self, url: str, opts: OpenOptions, size: int | None) -> None:
        self.url, self.size = url, size
        self._fs, self._path = filesystem(url, opts)
        self._deadline = opts.request_deadline
        self._timeout = deadline(self._fs, opts)
        # the ETag is pinned by the first GET, not the HEAD: a HEAD answered by another layer
        # (a redirecting front, a CDN) may tag the object differently; the size must agree
        self._pin = Pin(size=size)
        self._get = get_range if is_http(url) else s3_get_range if protocol_of(url) in ("s3", "s3a") else None

    def fetch(self, start: int, end: int) -> bytes:
        if self._get is not None:
            return self._get(self._fs, self._path, start, end, self._pin, self._deadline)
        return self._fs.cat_file(self._path, start=start, end=end, **self._timeout)

    def length(self) -> int | None:
        return self.size

    def close(self) -> None:
        pass


class _Prefetch:
    """One block fetched in a daemon thread (a hung request must not hold up process exit)."""

    def __init__(self, fetch: Any, start: int, end: int, stats: IOStats | None) -> None:
        self.start, self.end, self._stats = start, end, stats
        self._done = threading.Event()
        self._data: bytes | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fetch,), daemon=True, name="streampack-prefetch").start()

    def _run(self, fetch: Any) -> None:
        try:
            self._data = fetch(self.start, self.end)
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread
            self._error = e
            if isinstance(e, Transient) and self._stats is not None:
                self._stats.count(fault=e.kind)  # counted when it happens, even if never needed
        finally:
            self._done.set()

    def result(self) -> bytes:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._data is not None
        return self._data


class SeekableRaw(io.RawIOBase):
    """A raw stream that keeps its own position ``_pos``, read from a loaded block ``_buf`` that starts at
    ``_buf_at``; ``_size()`` is where ``SEEK_END`` counts from."""

    _pos: int
    _buf: Any
    _buf_at: int

    def _loaded(self) -> bool:
        return self._buf_at <= self._pos < self._buf_at + len(self._buf)

    def _deliver(self, b: Any, want: int) -> int:
        """Up to ``want`` bytes of the loaded block from ``_pos`` into ``b``."""
        i = self._pos - self._buf_at
        n = min(want, len(self._buf) - i)
        memoryview(b).cast("B")[:n] = self._buf[i:i + n]
        self._pos += n
        return n

    def _size(self) -> int:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            pos += self._pos
        elif whence == io.SEEK_END:
            pos += self._size()
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos


class ResumableStream(SeekableRaw):
    """Bytes ``[start, end)`` of one shard (to its end when ``end`` is None), seekable; every
    fault is retried at the current offset under ``opts.retry``."""

    def __init__(self, source: _Local | _Remote, *, url: str, start: int, end: int | None, opts: OpenOptions,
                 stats: IOStats | None, block: int) -> None:
        super().__init__()
        self._src, self._url, self._opts, self._stats = source, url, opts, stats
        self._local = isinstance(source, _Local)
        self._start, self._pos, self._block_size = start, start, block
        self._end = end if end is not None else source.size
        self._eof: int | None = None  # where the data ended, when the size was not known
        self._buf, self._buf_at = memoryview(b""), start
        self._ahead: _Prefetch | None = None

    def _size(self) -> int:
        end = self._end if self._end is not None else self._src.length()
        if end is None:
            raise io.UnsupportedOperation(f"size of {self._url} unknown: cannot seek from its end")
        return end

    def readinto(self, b: Any) -> int:
        limit = self._eof if self._eof is not None else self._end
        want = len(b) if limit is None else min(len(b), limit - self._pos)
        if want <= 0:
            return 0
        if not self._loaded():
            self._load(want)
            if not self._loaded():
                return 0  # the data ended here (size unknown)
        return self._deliver(b, want)

    def close(self) -> None:
        if not self.closed:
            self._ahead, self._buf = None, memoryview(b"")
            self._src.close()
        super().close()

    # ---------------------------------------------------------------- blocks
    def _load(self, want: int) -> None:
        """Make the block holding ``self._pos`` current (fetching it, with retries)."""
        pos, gap = self._pos, self._pos - (self._buf_at + len(self._buf))
        sequential = 0 <= gap < self._block_size or pos == self._start  # a forward skip counts as sequential
        ahead, self._ahead = self._ahead, None
        first: Transient | None = None
        data: bytes | None = None
        if ahead is not None and ahead.start <= pos < ahead.end:  # the prefetched block holds it
            start, end = ahead.start, ahead.end
            try:
                data = ahead.result()
            except Transient as e:  # the background attempt failed: this run of failures starts with it
                first = e
        else:
            start, size = pos, max(want, BUFFER) if self._local else self._block_size
            end = start + size if self._end is None else min(start + size, self._end)
        if data is None:
            data = with_retries(lambda: self._attempt(start, end), url=self._url, policy=self._opts.retry,
                                stats=self._stats, reason="corrupt_shard" if self._local else "unreachable_url",
                                first_failure=first)
        self._buf, self._buf_at = memoryview(data), start
        if len(data) < end - start:  # a local file or an object of unknown size: its data ends here
            self._eof = start + len(data)
        elif sequential and not self._local and (self._end is None or end < self._end):
            nxt = end + self._block_size if self._end is None else min(end + self._block_size, self._end)
            self._ahead = _Prefetch(self._attempt, end, nxt, self._stats)

    def _attempt(self, start: int, end: int) -> bytes:
        if self._stats is not None and not self._local:
            self._stats.count(requests=1)
        try:
            data = self._src.fetch(start, end)
        except Exception as e:  # noqa: BLE001 - sorted by classify; non-I/O errors re-raised as is
            failure = classify(e, self._url, local=self._local)
            if failure is e:
                raise
            if isinstance(failure, Transient):
                self._src.close()
            raise failure from None
        return self._checked(data, start, end)

    def _checked(self, data: Any, start: int, end: int) -> bytes:
        """``data`` if it is the block ``[start, end)``; raises the fault it shows otherwise."""
        if self._stats is not None and not self._local:
            self._stats.count(nbytes=len(data))
        asked = end - start
        if len(data) > asked:
            if self._src.size is not None and len(data) == self._src.size:  # a server that ignores Range
                return bytes(data[start:end])
            raise DataError("unreachable_url", f"asked for {asked} bytes at offset {start}, got {len(data)}",
                            url=self._url, value=start)
        if len(data) < asked and self._end is not None and not self._local:  # a body that ended early
            self._src.close()
            raise Transient("short_read", detail=f"{len(data)} of {asked} bytes at offset {start}")
        return bytes(data)


def open_shard(url: str, offset: int = 0, end: int | None = None, *, opts: OpenOptions = OpenOptions(),
               stats: IOStats | None = None) -> BinaryIO:
    """A buffered, seekable stream of bytes ``[offset, end)`` of ``url`` (to its end if None);
    ``DataError("missing_shard")`` here for a missing shard."""
    if offset < 0 or (end is not None and end < offset):
        raise ValueError(f"bad byte range {offset=} {end=} for {url!r}")
    if url.startswith("pipe:"):
        return _open_pipe(url, offset, opts)
    remote = is_remote(url)
    # a remote object read to its end: its size is where its bytes must end
    source = (_Remote(url, opts, stat(url, opts, stats).size if end is None else None) if remote
              else _Local(local_path(url)))
    raw = ResumableStream(source, url=url, start=offset, end=end, opts=opts, stats=stats,
                          block=opts.block_size if remote else BUFFER)
    return io.BufferedReader(raw, buffer_size=BUFFER)  # type: ignore[return-value]


def read_range(url: str, start: int, end: int, opts: OpenOptions, stats: IOStats | None = None) -> bytes | bytearray:
    """Bytes ``[start, end)`` of ``url`` in one ranged read; a short read is the shard's ``DataError``. A local file is
    read straight into the result (:func:`read_reusing`: one copy; through :class:`ResumableStream` a read is copied
    twice, its block and then the caller's buffer), retried under ``opts.retry`` as any local read."""
    if end <= start:
        return b""
    if url.startswith("pipe:") or is_remote(url):
        with open_shard(url, start, end, opts=opts, stats=stats) as f:
            data = f.read(end - start)
    else:
        path = local_path(url)
        data = with_retries(lambda: _read_local(path, url, start, end), url=url, policy=opts.retry, stats=stats,
                            reason="corrupt_shard")
    if len(data) != end - start:
        raise DataError("corrupt_shard", f"read {len(data)} of bytes [{start}, {end})", url=url, value=start)
    return data


def _read_local(path: str, url: str, start: int, end: int) -> bytes | bytearray:
    source = _Local(path)  # a missing file: its DataError
    try:
        f = source._file()
        f.seek(start)
        return read_reusing(f, end - start)
    except Exception as e:  # noqa: BLE001 - sorted by classify; non-I/O errors re-raised as is
        failure = classify(e, url, local=True)
        if failure is e:
            raise
        raise failure from None
    finally:
        source.close()


def read_reusing(f: BinaryIO, want: int) -> bytes | bytearray:
    """``f.read(want)``; from a plain local file, into the buffer of an earlier read that nothing views any more (its
    arrays are gone), since the first writes to a fresh 8 MB buffer fault in its ~2,000 pages one by one. Any other
    stream (remote, or one a test wraps) is read as asked."""
    if type(f) is not io.BufferedReader or want < SPARE_MIN:
        return f.read(want)
    with _SPARE_LOCK:  # taken under the lock: once held here, its count shows it in use to any other reader
        buf = next((b for b in SPARE if sys.getrefcount(b) == 3 and _unexported(b)), None)  # the list, the loop,
        # the call: nothing else holds it (a count an interpreter keeps lower is caught by the buffer's exports)
        if buf is None:
            buf = bytearray(want)
            SPARE.append(buf)
            if len(SPARE) > _SPARE_COUNT:
                SPARE.pop(0)  # still viewed: it goes when its arrays do
        elif len(buf) > want:
            del buf[want:]
        elif len(buf) < want:
            buf.extend(bytes(want - len(buf)))
    got = f.readinto(buf) or 0
    if got < want:
        del buf[got:]
    return buf


def _unexported(buf: bytearray) -> bool:
    """Whether no array or memoryview views ``buf``: a bytearray with live exports cannot be resized."""
    try:
        buf.append(0)
    except BufferError:
        return False
    buf.pop()
    return True


SPARE: list[bytearray] = []
"""Buffers of earlier reads, in the order they were made; one whose only reference is this list is free."""
_SPARE_LOCK = threading.Lock()
_SPARE_COUNT = 4
SPARE_MIN = 1 << 20
"""Reads smaller than this are read as asked (a fresh buffer of their size)."""


def _open_pipe(url: str, offset: int, opts: OpenOptions) -> BinaryIO:
    if not opts.allow_pipe:
        raise ValueError(f"refusing {url!r}: pass allow_pipe=True to run shell commands")
    proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    skip_bytes(proc.stdout, offset, url)
    return proc.stdout  # type: ignore[return-value]


def skip_bytes(f: BinaryIO, n: int, url: str, why: str = "stream ended before the resume offset",
               at: int | None = None) -> None:
    """Read and drop ``n`` bytes of a stream that cannot seek (a pipe, a decompressor, a tar member's data), in 1 MiB
    chunks (a declared size may be absurd); a short stream raises ``DataError("corrupt_shard", why)`` whose value is
    ``at``, or the bytes still missing."""
    while n > 0:
        chunk = f.read(min(n, _DISCARD_CHUNK))
        if not chunk:
            raise DataError("corrupt_shard", why, url=url, value=n if at is None else at)
        n -= len(chunk)


__all__ = ["OpenOptions", "ResumableStream", "SeekableRaw", "open_shard", "read_range", "read_reusing", "skip_bytes"]
