"""Images in samples: header-only sizes, token-count rules, placeholders, decode after packing.

Data flow: a reader attaches each sample's image *bytes* with their header (:mod:`.header`);
:class:`.stage.ExpandImages` turns every image placeholder into the rule's number of image
tokens (:mod:`.tokens`, :mod:`.placeholders`), so the packer sees true lengths; only the samples
of emitted packs are decoded to pixels (:mod:`.decode`, :class:`.node.DecodeImages`).
"""

from streampack.media.header import ImageHeader, MediaImage, read_header
from streampack.media.options import MediaOptions
from streampack.media.tokens import AnyResTiles, DynamicResolution, FixedTokens, TokenRule

__all__ = ["AnyResTiles", "DynamicResolution", "FixedTokens", "ImageHeader", "MediaImage", "MediaOptions",
           "TokenRule", "read_header"]
