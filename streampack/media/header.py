"""An image's size and mode from its header only: what its token count needs, before any pixel.

``PIL.Image.open`` parses only the header (623 bytes of a JPEG, 41 of a PNG; ~30-75 us per image against 3-260 ms for a
full decode, ``benchmarks/bench_media.py``), except for WebP, whose ``open`` reads the whole file (2.5 ms at 1080p):
WebP's size and alpha are read here from the first 30 bytes of its RIFF header (RFC 9649), ~5 us. Untrusted bytes: only
the JPEG, PNG and WebP decoders are ever tried, the declared size is checked against ``Limits.max_image_pixels`` before
any decode, and a mode that cannot become RGB is refused, each as a :class:`~streampack.errors.DataError` naming shard,
key and image.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from streampack.errors import DataError

FORMATS = ("JPEG", "PNG", "WEBP")
"""The only decoders tried; anything else is ``bad_image``."""
MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr"})
"""8-bit and palette modes, which convert to RGB as the HF processors convert them. Others are
``unsupported_image_mode``: 16-bit grey PNG (``I;16``, which ``convert("RGB")`` clips at 255
rather than scales, so no processor reading is right) and 32-bit ``I`` / float ``F``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageHeader:
    """What an image's header says."""

    width: int
    height: int
    mode: str
    """PIL mode (``RGB``, ``L``, ``P``...)."""
    format: str
    """``JPEG``, ``PNG`` or ``WEBP``."""

    @property
    def pixels(self) -> int:
        return self.width * self.height


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaImage:
    """One image of a sample between reading and decoding: its encoded bytes and header.
    A resume state never holds it (carried samples are re-read from their origin)."""

    name: str
    """Where it came from in the sample: the tar member, column or path."""
    data: bytes
    header: ImageHeader


def read_header(data: bytes, *, url: str, key: str, name: str, max_pixels: int) -> ImageHeader:
    """The header of the encoded image ``data``; raises :class:`DataError` (``bad_image``,
    ``image_too_large``, ``unsupported_image_mode``) naming ``url``, ``key`` and ``name``."""
    from PIL import Image

    header = webp_header(data)
    try:
        if header is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
                with Image.open(io.BytesIO(data), formats=FORMATS) as im:
                    header = ImageHeader(width=int(im.width), height=int(im.height), mode=str(im.mode),
                                         format=str(im.format))
    except Image.DecompressionBombError as e:
        raise DataError("image_too_large", f"image {name!r}: {e}", url=url, key=key, value=name) from None
    except Image.UnidentifiedImageError:  # its message names only a BytesIO's address
        raise DataError("bad_image", f"image {name!r} ({len(data)} bytes) is not a JPEG, PNG or WebP file: its "
                        "first bytes match none of their signatures", url=url, key=key, value=name) from None
    except Exception as e:  # noqa: BLE001 — PIL raises many types for a bad header; all mean "not an image"
        raise DataError("bad_image", f"image {name!r} has no readable JPEG/PNG/WebP header: {e}", url=url, key=key,
                        value=name) from None
    check_header(header, url=url, key=key, name=name, max_pixels=max_pixels)
    return header


def webp_header(data: bytes) -> ImageHeader | None:
    """Size and mode of a WebP from its RIFF header, or None when ``data`` is not one this reads."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    kind = data[12:16]
    if kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy: a key frame's start code, then 14-bit sizes
        width, height = (int.from_bytes(data[26:28], "little") & 0x3FFF), (int.from_bytes(data[28:30], "little") & 0x3FFF)
        alpha = False
    elif kind == b"VP8L" and data[20] == 0x2F:  # lossless: 14-bit width-1, height-1, then the alpha hint
        bits = int.from_bytes(data[21:25], "little")
        width, height, alpha = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, bool(bits >> 28 & 1)
    elif kind == b"VP8X":  # extended: flags (alpha = 0x10), 24-bit canvas width-1, height-1
        width, height = int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
        alpha = bool(data[20] & 0x10)
    else:
        return None
    return ImageHeader(width=width, height=height, mode="RGBA" if alpha else "RGB", format="WEBP")


def check_header(header: ImageHeader, *, url: str, key: str, name: str, max_pixels: int) -> None:
    if header.width < 1 or header.height < 1:
        raise DataError("bad_image", f"image {name!r} declares {header.width}x{header.height} pixels", url=url,
                        key=key, value=(header.width, header.height))
    if header.pixels > max_pixels:
        raise DataError("image_too_large", f"image {name!r} declares {header.width}x{header.height} = "
                        f"{header.pixels} pixels, over max_image_pixels={max_pixels}; not decoded", url=url, key=key,
                        value=(header.width, header.height))
    if header.mode not in MODES:
        raise DataError("unsupported_image_mode", f"image {name!r} has mode {header.mode!r}; supported: "
                        f"{sorted(MODES)}", url=url, key=key, value=header.mode)


def read_images(named: list[tuple[str, bytes]], *, url: str, key: str, max_pixels: int) -> tuple[MediaImage, ...]:
    """Every ``(name, bytes)`` of one sample as a :class:`MediaImage`, in order."""
    out = []
    for name, data in named:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DataError("bad_image", f"image {name!r} is {type(data).__name__}, want bytes", url=url, key=key,
                            value=name)
        data = bytes(data)
        out.append(MediaImage(name=name, data=data, header=read_header(data, url=url, key=key, name=name,
                                                                       max_pixels=max_pixels)))
    return tuple(out)
