"""Terminal pictures: a pack's layout as a bar of documents and padding, and fill bars.

Adjacent documents alternate glyphs (``█`` / ``▓``) so they stay distinguishable without
colour; with colour (a tty, and ``NO_COLOR`` unset) they also cycle through six ANSI colours.
A terminal that cannot encode the block glyphs gets ``#`` / ``=`` / ``.``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO

_COLORS = ("\033[36m", "\033[33m", "\033[35m", "\033[32m", "\033[34m", "\033[31m")
_DIM = "\033[2m"
_RESET = "\033[0m"


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def glyphs(stream: TextIO) -> tuple[str, str, str]:
    """(document glyph, alternate document glyph, padding glyph) the stream can print."""
    encoding = getattr(stream, "encoding", None) or "ascii"
    try:
        "█▓·".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "#", "=", "."
    return "█", "▓", "·"


def _cells(sizes: Sequence[int], width: int, visible: Sequence[bool] | None = None) -> list[int]:
    """Split ``width`` cells over segments proportionally to ``sizes`` (largest remainder);
    every non-empty ``visible`` segment gets at least one cell while the width allows."""
    total = sum(sizes)
    if total == 0:
        return [0] * len(sizes)
    exact = [s * width / total for s in sizes]
    cells = [int(e) for e in exact]
    for i in sorted(range(len(sizes)), key=lambda i: exact[i] - cells[i], reverse=True):
        if sum(cells) >= width:
            break
        cells[i] += 1
    for i, s in enumerate(sizes):
        if s > 0 and cells[i] == 0 and (visible is None or visible[i]):
            donor = max(range(len(cells)), key=cells.__getitem__)
            if cells[donor] > 1:
                cells[donor] -= 1
                cells[i] = 1
    return cells


def pack_layout(cu_seqlens: Sequence[int], cu_seqlens_padded: Sequence[int], *, width: int = 72,
                color: bool = False, glyph: tuple[str, str, str] = ("█", "▓", "·")) -> str:
    """One pack as a bar of ``width`` cells, real tokens in alternating glyphs and padding in the padding
    glyph; ``cu_seqlens`` / ``cu_seqlens_padded`` are offsets inside the pack (e.g. ``[0, 3, 5]`` / ``[0, 4, 8]``)."""
    segments: list[tuple[int, int]] = []  # (doc index or -1 for padding, tokens)
    for i in range(len(cu_seqlens) - 1):
        real = cu_seqlens[i + 1] - cu_seqlens[i]
        span = cu_seqlens_padded[i + 1] - cu_seqlens_padded[i]
        segments.append((i, real))
        segments.append((-1, span - real))
    # every document stays visible; a few tokens of alignment padding may round to nothing
    cells = _cells([n for _, n in segments], width, [doc >= 0 for doc, _ in segments])
    out: list[str] = []
    for (doc, _), n in zip(segments, cells):
        if n == 0:
            continue
        if doc < 0:
            out.append(f"{_DIM}{glyph[2] * n}{_RESET}" if color else glyph[2] * n)
        else:
            text = glyph[doc % 2] * n
            out.append(f"{_COLORS[doc % len(_COLORS)]}{text}{_RESET}" if color else text)
    return "".join(out)


def fill_bar(fraction: float, *, width: int = 30, glyph: tuple[str, str, str] = ("█", "▓", "·")) -> str:
    full = max(0, min(width, round(fraction * width)))
    return glyph[0] * full + glyph[2] * (width - full)


def short_list(values: Sequence[int], limit: int = 24) -> str:
    """``[0, 3, 5]``; long lists keep the head and tail around ``...``."""
    values = [int(v) for v in values]
    if len(values) <= limit:
        return "[" + ", ".join(map(str, values)) + "]"
    half = limit // 2
    head = ", ".join(map(str, values[:half]))
    tail = ", ".join(map(str, values[-half:]))
    return f"[{head}, ... ({len(values) - 2 * half} more) ..., {tail}]"


def layout_block(cu_seqlens: Sequence[int], cu_seqlens_padded: Sequence[int], *, capacity: int,
                 title: str, stream: TextIO | None = None, width: int = 72) -> str:
    """Title, bar with a 0/capacity ruler, legend, and both cu_seqlens lists."""
    stream = sys.stdout if stream is None else stream
    glyph = glyphs(stream)
    bar = pack_layout(cu_seqlens, cu_seqlens_padded, width=width, color=use_color(stream), glyph=glyph)
    ruler = "0".ljust(width - len(str(capacity))) + str(capacity)
    n = len(cu_seqlens) - 1
    real = int(cu_seqlens[-1] - cu_seqlens[0])
    lines = [
        title,
        f"  |{bar}|",
        f"   {ruler}",
        f"  {glyph[0]}{glyph[1]} = {n} documents ({real} tokens)   {glyph[2]} = padding "
        f"({capacity - real} token{'' if capacity - real == 1 else 's'})",
        f"  cu_seqlens        = {short_list(cu_seqlens)}",
        f"  cu_seqlens_padded = {short_list(cu_seqlens_padded)}",
    ]
    return "\n".join(lines)


__all__ = ["fill_bar", "glyphs", "layout_block", "pack_layout", "short_list", "use_color"]
