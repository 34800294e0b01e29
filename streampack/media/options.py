"""``PackedDataset(media=MediaOptions(...))``: where a sample's images are and how they count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streampack.media.tokens import RULES, AnyResTiles, DynamicResolution, TokenRule

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaOptions:
    """Images of image-text samples (one record: every value is validated here, once)."""

    rule: TokenRule
    """Token count (and encoder input size) of an image: ``FixedTokens`` (LLaVA-1.5),
    ``DynamicResolution`` (Qwen2-VL) or ``AnyResTiles`` (LLaVA-NeXT; lengths only)."""
    image_token_id: int
    """The placeholder id: one per image in the tokenized text, expanded to the image's count."""
    image_exts: tuple[str, ...] = IMAGE_EXTS
    """Tar member extensions that are images; a sample's images are its members with these
    extensions in member-name order (``0.jpg`` < ``1.png``, or ``a.jpg`` < ``b.jpg``)."""
    images_key: str = "images"
    """json / parquet field: a list of image paths (jsonl, relative to ``image_root``) or of
    HF datasets ``{"bytes": ..., "path": ...}`` structs / raw bytes (parquet)."""
    image_root: str | None = None
    """Directory or URL prefix that jsonl image paths are relative to (NeVA's ``image_folder``);
    read through the same storage layer as the shards."""
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    """Per-channel normalisation (OpenAI CLIP's, what Qwen2-VL's and LLaVA's processors use)."""
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale: float = 1 / 255

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

    @property
    def flat_patches(self) -> bool:
        """Pixels as Qwen2-VL's flattened patches ``[Σ patches, C·t·p·p]`` (else ``[n, 3, H, W]``)."""
        return isinstance(self.rule, DynamicResolution)

    @property
    def decodes(self) -> bool:
        """Whether pixels can be produced for this rule (any-res tiles count tokens only)."""
        return not isinstance(self.rule, AnyResTiles)

    # The readers (streampack.io) call these: io imports nothing of streampack.media.
    def is_image_field(self, field: str) -> bool:
        """Whether the tar member field ``field`` (``0.jpg``) is an image."""
        return field.rsplit(".", 1)[-1].lower() in self.image_exts

    def tar_images(self, fields: dict[str, bytes], limits: Any, *, url: str, key: str) -> tuple[Any, ...]:
        from streampack.media.read import tar_images

        return tar_images(fields, self, limits, url=url, key=key)

    def column_images(self, value: Any, limits: Any, *, url: str, key: str) -> tuple[Any, ...]:
        from streampack.media.read import column_images

        return column_images(value, self, limits, url=url, key=key)

    def path_images(self, value: Any, limits: Any, *, url: str, key: str) -> tuple[Any, ...]:
        from streampack.media.read import path_images

        return path_images(value, self, limits, url=url, key=key)
