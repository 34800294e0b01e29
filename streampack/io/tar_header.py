"""One tar header block -> its fields, strictly: what is not a valid header says so.

``tarfile`` is lenient where a streaming reader of untrusted shards cannot be: ``int()`` accepts ``"-1"``, ``"+7"`` and
``"1_0"`` in a size field, and its pax parser raises bare ``ValueError``s (or, for a record of length 0, loops forever
in older readers). Every problem here is an :class:`Unreadable` that the stream turns into a corrupt region.
"""

from __future__ import annotations

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_DECLARED = 1 << 48
"""256 TiB: past any real member, and ``seek()`` offsets stay in range."""
REGULAR = (b"0", b"\0", b"7")
"""Type flags of a member read as a file (``7``: contiguous); both readers skip the others."""
PAX = b"x"
EXTENSIONS = (b"L", b"K", PAX, b"g")
"""Type flags of the headers that describe the member after them (or, ``g``, none)."""


def padded(size: int) -> int:
    """``size`` data bytes with the padding to the next header."""
    return (size + BLOCK - 1) & -BLOCK


class Unreadable(Exception):
    """A block that should be a header is not one (the stream makes it a ``CorruptRegion``);
    ``poison``: an extension header, so the member it describes cannot be trusted either."""

    def __init__(self, detail: str, *, first: int, at: int, poison: bool = False, name: str | None = None) -> None:
        super().__init__(detail)
        self.detail, self.first, self.at, self.poison = detail, first, at, poison
        self.name = name
        """The member's name when its header parsed but its size is impossible."""
        self.resume = at + BLOCK
        """Where the stream stands, so where a resync scans from (past an extension's data
        when that data was read before it proved malformed)."""


def _number(field: bytes) -> int:
    if field[:1] == b"\x80":  # GNU base-256 for sizes over 8 GiB (0xff would be negative)
        return int.from_bytes(field[1:], "big")
    digits = field.replace(b"\0", b" ").strip()
    if not digits:
        return 0
    if not digits.isdigit():  # int() would accept "-1", "+7", "1_0", " 1 2"; it refuses 8 and 9
        raise ValueError(f"non-octal field {field!r}")
    return int(digits, 8)


def parse_header(hdr: bytes, *, first: int, at: int) -> tuple[str, int, bytes]:
    """``(name, size, type flag)`` of the header block ``hdr`` found at ``at`` (``first``: where
    the member's headers began)."""
    try:
        stored, size = _number(hdr[148:156]), _number(hdr[124:136])
    except ValueError:
        raise Unreadable("unparsable tar header", first=first, at=at) from None
    if stored != sum(hdr[:148]) + 256 + sum(hdr[156:]) and stored != _signed_checksum(hdr):
        raise Unreadable("tar header checksum mismatch", first=first, at=at)
    if size >= MAX_DECLARED:
        raise Unreadable(f"tar header declares a {size}-byte member", first=first, at=at)
    name = hdr[:100].split(b"\0", 1)[0]
    if hdr[257:262] == b"ustar":
        prefix = hdr[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape"), size, hdr[156:157]


def _signed_checksum(hdr: bytes) -> int:
    """The checksum old writers computed over signed chars (tarfile accepts it too)."""
    high = sum(1 for b in hdr[:148] if b >= 128) + sum(1 for b in hdr[156:] if b >= 128)
    return sum(hdr[:148]) + 256 + sum(hdr[156:]) - 256 * high


def opens_region(block: bytes) -> bool:
    """Whether ``block``, read past a range's end, is neither the archive's end nor a valid header
    of a plain member (an extension header's content could still prove malformed): then both
    readers judge the range's last sample by the samples after it."""
    return bool(block) and block != ZERO_BLOCK and not (is_header(block) and block[156:157] in REGULAR)


def is_header(block: bytes) -> bool:
    """Whether ``block`` is a valid ustar header (what a resync looks for)."""
    if block[257:262] != b"ustar":  # cheap filter before the checksum
        return False
    try:
        parse_header(block, first=0, at=0)
    except Unreadable:
        return False
    return True


def parse_pax(data: bytes, *, first: int, at: int) -> dict[str, str]:
    """Records ``"<len> <key>=<value>\\n"``; anything else is a malformed header."""
    out, i = {}, 0
    while i < len(data):
        sp = data.find(b" ", i, i + 20)
        n = int(data[i:sp]) if sp > i and data[i:sp].isdigit() else 0
        end = i + n
        if sp <= i or n <= sp - i + 1 or end > len(data) or data[end - 1] != 0x0A or b"=" not in data[sp + 1 : end]:
            raise Unreadable(f"malformed pax header record at byte {i}", first=first, at=at, poison=True)
        k, _, v = data[sp + 1 : end - 1].partition(b"=")
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        i = end
    size = out.get("size")
    if size is not None and not (size.isascii() and size.isdigit()):
        raise Unreadable(f"pax size {size[:20]!r} is not a number", first=first, at=at, poison=True)
    return out
