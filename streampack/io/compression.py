"""Compressed jsonl: ``.gz`` and ``.zst``, streamed: neither can seek, so resuming decompresses and drops everything
before the offset (O(offset), 0.3-2 GB/s on one core; docs/storage.md).

zstandard's reader returns a frame cut short as if it were whole, so :class:`ZstdReader` follows the frame layout itself
(frame and block headers only) and raises :class:`CorruptStream` when the input stops anywhere but between two frames.
Each frame gets a reader of its own, so a frame that fails costs no line of the frames before it: ~15 us a frame
(1.5-2x on a file of one line per frame, nothing for 1 MiB frames).
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections import deque
from typing import Any, BinaryIO


class CorruptStream(Exception):
    """Undecodable or truncated compressed data (raised by :class:`ZstdReader`)."""


DECOMPRESS_ERRORS: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError, zlib.error, CorruptStream)
"""What a damaged ``.gz`` / ``.zst`` raises while decompressing (``zlib.error`` for bad deflate
data, which is neither an ``OSError`` nor an ``EOFError``). Other ``OSError`` s are I/O failures
that the stream below already retried; they propagate."""

COMPRESSED_SUFFIXES = (".gz", ".zst")


def compression_of(url: str) -> str | None:
    """``"gz"``, ``"zst"`` or None, from the URL's suffix (query string ignored)."""
    path = url.split("?", 1)[0]
    return next((s[1:] for s in COMPRESSED_SUFFIXES if path.endswith(s)), None)


def text_stream(raw: BinaryIO, url: str) -> BinaryIO:
    """The uncompressed byte stream of a jsonl shard opened at byte 0."""
    kind = compression_of(url)
    if kind == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if kind == "zst":
        return io.BufferedReader(ZstdReader(raw), buffer_size=1 << 16)  # type: ignore[return-value]
    return raw


class _FrameTracker:
    """Follows zstd frame / block headers (RFC 8878 3.1) to know whether the input ended between frames
    and where bytes that start no frame begin; never raises (``error``, ``confirmed`` stops there)."""

    MAGIC, SKIPPABLE = 0xFD2FB528, 0x184D2A50

    def __init__(self) -> None:
        self._pending = bytearray()  # header bytes being collected
        self._need, self._skip, self._state = 4, 0, "magic"
        self._checksum = False
        self._fed = 0  # compressed bytes seen so far
        self._header_at = 0  # where the header being collected starts
        self.frame_ends: deque[int] = deque()
        """Compressed offsets where a frame (zstd or skippable) ends, each known once the
        frame's last block header (or a skippable frame's size) has been fed."""
        self.error: str | None = None
        """What is wrong at ``confirmed`` (bytes that start no zstd frame), once seen."""

    @property
    def between_frames(self) -> bool:
        return self._state == "magic" and not self._pending and not self._skip

    @property
    def confirmed(self) -> int:
        """Compressed bytes that may go to the decompressor: all but a frame magic still being
        collected (``zstandard`` raises on a partial bad magic and drops the output it held)."""
        if self.error is not None or (self._state == "magic" and self._pending):
            return self._header_at
        return self._fed

    def feed(self, data: bytes) -> None:
        view, i = memoryview(data), 0
        while i < len(view) and self.error is None:
            if self._skip:
                step = min(self._skip, len(view) - i)
                self._skip -= step
                i += step
                continue
            if not self._pending:
                self._header_at = self._fed + i
            take = min(self._need - len(self._pending), len(view) - i)
            self._pending += view[i:i + take]
            i += take
            if len(self._pending) == self._need:
                header, self._pending = bytes(self._pending), bytearray()
                try:
                    self._advance(header)
                except CorruptStream as e:
                    self.error = f"{e} at compressed byte {self._header_at}"
        self._fed += len(data)

    def _advance(self, h: bytes) -> None:
        if self._state == "magic":
            magic = int.from_bytes(h, "little")
            if magic == self.MAGIC:
                self._state, self._need = "descriptor", 1
            elif magic & 0xFFFFFFF0 == self.SKIPPABLE:
                self._state, self._need = "skippable", 4
            else:
                raise CorruptStream(f"not a zstd frame (magic {magic:#x})")
        elif self._state == "skippable":
            self._state, self._need, self._skip = "magic", 4, int.from_bytes(h, "little")
            self.frame_ends.append(self._header_at + 4 + self._skip)
        elif self._state == "descriptor":
            fhd = h[0]
            single, did, fcs = (fhd >> 5) & 1, fhd & 3, fhd >> 6
            self._checksum = bool((fhd >> 2) & 1)
            rest = (0 if single else 1) + (0, 1, 2, 4)[did] + ((1 if single else 0), 2, 4, 8)[fcs]
            self._state, self._need, self._skip = "block", 3, rest
        elif self._state == "block":
            header = int.from_bytes(h, "little")
            last, kind, size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3:
                raise CorruptStream("reserved zstd block type")
            self._skip = 1 if kind == 1 else size
            if last:
                self._state, self._need = "magic", 4
                self._skip += 4 if self._checksum else 0
                self.frame_ends.append(self._header_at + 3 + self._skip)


class _Tracked(io.RawIOBase):
    """The compressed input, seen by the frame tracker on its way to the decompressor, which
    gets only the tracker's ``confirmed`` bytes (then an end of input, where damage starts)."""

    def __init__(self, raw: BinaryIO, tracker: _FrameTracker) -> None:
        super().__init__()
        self._raw, self._tracker = raw, tracker
        self._held = bytearray()  # read and fed, not yet handed on; starts at compressed byte `_passed`
        self._passed = 0
        self._eof = False

    def readable(self) -> bool:
        return True

    @property
    def at_frame_end(self) -> bool:
        """Whether every byte of the current frame has been handed on."""
        return bool(self._tracker.frame_ends) and self._tracker.frame_ends[0] == self._passed

    @property
    def drained(self) -> bool:
        """Whether the input has ended and every byte of it has been handed on."""
        return self._eof and not self._held

    def _ready(self) -> int:
        """Bytes that may be handed on now: confirmed ones, up to the current frame's end."""
        ends = self._tracker.frame_ends
        return min(self._tracker.confirmed, ends[0] if ends else self._tracker.confirmed) - self._passed

    def readinto(self, b: Any) -> int:
        ready = self._ready()
        while ready <= 0:
            if self._eof or self._tracker.error is not None or self.at_frame_end:
                return 0
            data = self._raw.read(len(b))
            if not data:
                self._eof = True
                return 0
            self._held += data
            self._tracker.feed(data)
            ready = self._ready()
        n = min(len(b), ready)
        memoryview(b).cast("B")[:n] = self._held[:n]
        del self._held[:n]
        self._passed += n
        return n


class ZstdReader(io.RawIOBase):
    """Decompressed bytes of a zstd stream, across frames; truncation raises CorruptStream."""

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard

        super().__init__()
        self._tracker = _FrameTracker()
        self._tracked = _Tracked(raw, self._tracker)
        self._dctx = zstandard.ZstdDecompressor()
        self._reader = self._frame_reader()
        self._zstd_error = zstandard.ZstdError

    def _frame_reader(self) -> Any:
        # One reader per frame, fed only that frame's bytes: a reader that reads across frames
        # decompresses into the caller's buffer until it is full, so a bad frame after a good one
        # raised in the same read and took the good frame's output with it (0 of 10 lines kept).
        return self._dctx.stream_reader(self._tracked, read_across_frames=False, closefd=False)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while True:
            try:
                n = self._reader.readinto(b)
            except self._zstd_error as e:
                raise CorruptStream(str(e)) from None
            if n or not self._tracked.at_frame_end:
                break
            self._reader.close()
            self._tracker.frame_ends.popleft()  # the frame is done: the next reader starts after it
            self._reader = self._frame_reader()
        if n == 0 and self._tracker.error is not None:  # every byte before the damage was delivered
            raise CorruptStream(self._tracker.error)
        if n == 0 and not self._tracked.drained:  # never an end while input remains
            raise CorruptStream("zstd frame ended before the bytes its headers declare")
        if n == 0 and not self._tracker.between_frames:
            raise CorruptStream("zstd stream ended inside a frame (truncated)")
        return n

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()


__all__ = ["COMPRESSED_SUFFIXES", "DECOMPRESS_ERRORS", "CorruptStream", "ZstdReader", "compression_of", "text_stream"]
