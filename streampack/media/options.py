"""``PackedDataset(media=MediaOptions(...))``: where a sample's images and videos are and how they count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streampack.media.tokens import RULES, AnyResTiles, DynamicResolution, TokenRule, VideoFrames

if TYPE_CHECKING:
    from streampack.packing.cost import VisionCost

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaOptions:
    """Images and videos of multimodal samples (one record: every value is validated here, once)."""

    rule: TokenRule
    """Token count (and encoder input size) of an image: ``FixedTokens`` (LLaVA-1.5),
    ``DynamicResolution`` (Qwen2-VL) or ``AnyResTiles`` (LLaVA-NeXT)."""
    image_token_id: int
    """The placeholder id: one per image in the tokenized text, expanded to the image's count."""
    image_exts: tuple[str, ...] = IMAGE_EXTS
    """Tar member extensions that are images, taken in number order (``2.jpg`` < ``10.png``)."""
    images_key: str = "images"
    """json / parquet field: a list of image paths (jsonl, relative to ``image_root``) or of
    HF datasets ``{"bytes": ..., "path": ...}`` structs / raw bytes (parquet)."""
    image_root: str | None = None
    """Directory or URL prefix that jsonl image paths are relative to; nothing outside it is read
    (:mod:`streampack.media.paths`)."""
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    """Per-channel normalisation (OpenAI CLIP's, what Qwen2-VL's and LLaVA's processors use)."""
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale: float = 1 / 255
    video: VideoFrames | None = None
    """Read videos (ordered frame lists, :mod:`streampack.media.video`) with this rule; needs
    ``rule=DynamicResolution`` with the same sizes and ``video_token_id``. None: frames are images."""
    video_token_id: int | None = None
    """The video placeholder id (Qwen2-VL's ``<|video_pad|>``), one per video in the text."""
    videos_key: str = "video"
    """Tar member prefix (``video.<frame>.<ext>``) and json / parquet field of a sample's videos."""

    def __post_init__(self) -> None:
        if not isinstance(self.rule, RULES):
            raise TypeError(f"rule must be one of {[r.__name__ for r in RULES]}, got {type(self.rule).__name__}")
        if isinstance(self.image_token_id, bool) or not isinstance(self.image_token_id, int) or self.image_token_id < 0:
            raise ValueError(f"image_token_id={self.image_token_id!r} must be a token id >= 0")
        exts = tuple(e.lower().lstrip(".") for e in self.image_exts)
        if not exts or any(not e or "." in e for e in exts):
            raise ValueError(f"image_exts={self.image_exts!r} must be non-empty plain extensions")
        object.__setattr__(self, "image_exts", exts)
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"image_mean={self.image_mean} / image_std={self.image_std} must be 3 values (std > 0)")
        self._check_video()

    def _check_video(self) -> None:
        if (self.video is None) != (self.video_token_id is None):
            raise ValueError(f"video={self.video!r} and video_token_id={self.video_token_id!r} go together")
        if not self.videos_key or "." in self.videos_key:
            raise ValueError(f"videos_key={self.videos_key!r} must be a non-empty name without dots")
        if self.video is None:
            return
        if not isinstance(self.video, VideoFrames):
            raise TypeError(f"video must be a VideoFrames, got {type(self.video).__name__}")
        tid = self.video_token_id
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0 or tid == self.image_token_id:
            raise ValueError(f"video_token_id={tid!r} must be a token id >= 0 other than image_token_id")
        rule, frame = self.rule, self.video.frame
        sizes = ("patch_size", "merge_size", "temporal_patch_size")
        if not isinstance(rule, DynamicResolution) or any(getattr(rule, n) != getattr(frame, n) for n in sizes):
            raise ValueError(f"video= needs rule=DynamicResolution with the video frames' {sizes} "
                             f"({[getattr(frame, n) for n in sizes]}): one vision encoder; got {rule!r}")

    def recorded(self) -> dict[str, Any]:
        """What a resume state's fingerprint records: the fields, the video ones only when set."""
        out = dataclasses.asdict(self)
        if self.video is None and self.videos_key == "video":
            del out["video"], out["video_token_id"], out["videos_key"]
        return out

    def reading(self, opts: Any = None, stats: Any = None) -> Any:
        """A :class:`~streampack.media.read.MediaReader`: these options bound to a reader's ``OpenOptions``
        and ``IOStats`` (None: the defaults), what the format readers (``streampack.io``) call."""
        from streampack.io.storage import OpenOptions
        from streampack.media.read import MediaReader

        return MediaReader(options=self, open=opts if opts is not None else OpenOptions(), stats=stats)

    def vision_bound(self, vision: VisionCost, tokens: int) -> float:
        """The most ``tokens`` image tokens can cost ``vision``: every token an image's at the rule's densest patches
        per token, in segments of its largest frame (or tile). Cost-balanced emission spans its histogram to it; a
        very thin image that ``smart_resize``'s rounding takes over ``max_pixels`` costs more and counts in the top
        bin."""
        rule = self.rule
        if isinstance(rule, DynamicResolution):  # a token is merge² patches; a frame at most max_pixels
            frames = [rule] + ([self.video.frame] if self.video is not None else [])
            per_token = float(rule.merge_size ** 2)
            segment = max(f.max_pixels // f.patch_size ** 2 for f in frames)
        elif isinstance(rule, AnyResTiles):  # 1 + tiles segments for at least one tile's tokens
            segment = (rule.tile_size // rule.patch_size) ** 2
            per_token = 1.0 + max(h * w for h, w in rule.grid_pinpoints) / rule.tile_size ** 2
        else:
            per_token, segment = 1.0, rule.tokens
        patches = per_token * tokens
        return vision.linear * patches + vision.attention * patches * segment  # Σ S² <= segment · Σ S

    @property
    def layout(self) -> str:
        """How an image's pixels are laid out: ``patches`` (Qwen2-VL), ``tiles`` (LLaVA-NeXT) or ``image``."""
        if isinstance(self.rule, DynamicResolution):
            return "patches"
        return "tiles" if isinstance(self.rule, AnyResTiles) else "image"

    def is_image_field(self, field: str) -> bool:
        """Whether the tar member field ``field`` (``0.jpg``, ``video.3.jpg``) is an image or frame."""
        return field.rsplit(".", 1)[-1].lower() in self.image_exts
