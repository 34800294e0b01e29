"""Images and videos in samples: header-only sizes, token-count rules, placeholders, decode after packing.

Data flow: a reader attaches each sample's image *bytes* with their header (:mod:`.header`;
videos as ordered frames, :mod:`.video`; read with the dataset's settings, :mod:`.read`);
:class:`.stage.ExpandImages` turns every image / video placeholder into the rule's number of
tokens (:mod:`.tokens`, :mod:`.placeholders`), so the packer sees true lengths; only the samples
of emitted packs are decoded to pixels (:mod:`.decode`, :mod:`.tiles`, :mod:`.video_decode`,
:class:`.node.DecodeImages`). A sample's ``images`` tuple holds its :class:`MediaImage` and
:class:`MediaVideo` items (each kind in its placeholder order).
"""

from streampack.media.header import ImageHeader, MediaImage, read_header
from streampack.media.options import MediaOptions
from streampack.media.tokens import AnyResTiles, DynamicResolution, FixedTokens, TokenRule, VideoFrames
from streampack.media.video import MediaVideo

__all__ = ["AnyResTiles", "DynamicResolution", "FixedTokens", "ImageHeader", "MediaImage", "MediaOptions",
           "MediaVideo", "TokenRule", "VideoFrames", "read_header"]
