"""Images and videos in samples: header-only sizes, token-count rules, placeholders, decode after packing.

A reader attaches each sample's image bytes with their header (:mod:`.header`, :mod:`.video`, :mod:`.read`);
:class:`.stage.ExpandImages` expands every placeholder to the rule's token count (:mod:`.tokens`),
so the packer sees true lengths; only emitted packs are decoded to pixels (:class:`.node.DecodeImages`).
"""

from streampack.media.header import ImageHeader, MediaImage, read_header
from streampack.media.options import MediaOptions
from streampack.media.tokens import AnyResTiles, DynamicResolution, FixedTokens, TokenRule, VideoFrames
from streampack.media.video import MediaVideo

__all__ = ["AnyResTiles", "DynamicResolution", "FixedTokens", "ImageHeader", "MediaImage", "MediaOptions",
           "MediaVideo", "TokenRule", "VideoFrames", "read_header"]
