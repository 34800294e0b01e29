"""A video's frames -> Qwen2-VL's ``pixel_values_videos`` rows and ``video_grid_thw``, as
``Qwen2VLVideoProcessor`` makes them.

Runs only for samples of emitted packs (:class:`~streampack.media.node.DecodeImages`). The steps
are the processor's (transformers 5.24, torchvision backend), checked equal on the same frames
(``tests/unit/media/test_media_video.py``):

1. decode each frame to 8-bit RGB (transparency over white, as for images);
2. resize every frame to ``smart_resize`` of the frame size (``VideoFrames.frame``) with
   torch's antialiased bicubic on the uint8 frames (``F.interpolate(..., mode="bicubic",
   antialias=True)``: the kernel torchvision's ``resize`` calls for uint8 on the CPU; PIL's
   bicubic differs from it by up to 12 levels when upscaling, so the image path's PIL resize
   would not reproduce the processor), skipped when the size is already right;
3. ``(x - 255·mean) / (255·std)`` in float32 (the processor's fused rescale + normalise);
4. pad the frames to a multiple of the temporal patch (2) by repeating the last one, and cut
   ``[t, tp, C, h, w]`` into merge-window-ordered patches ``[t·gh·gw, C·tp·p·p]``.

The vision tower attends inside one temporal patch at a time (``t`` segments of ``gh·gw``
patches: ``streampack.layout.vision.vision_cu_seqlens``). Frames are decoded one at a time
and resized together; peak memory is the uint8 frames plus the float32 patches.

Cost per frame (``benchmarks/bench_media.py``, 8-frame videos of JPEG frames, best of 10,
shared 2-core box, loaded): the header that sizes it 44 us (640x480) / 85 us
(1920x1080), a full decode 2.2 / 18 ms, this whole path 14 / 50 ms; so packing by headers
reads 50-200x less CPU than decoding to count, and only emitted packs pay the 14-50 ms.
"""

from __future__ import annotations

import numpy as np

from streampack.media.decode import Pixels, open_rgb
from streampack.media.options import MediaOptions
from streampack.media.video import MediaVideo


def video_pixels(video: MediaVideo, options: MediaOptions, *, url: str, key: str) -> Pixels:
    """Decode, resize, normalise and patchify one video for ``options.video``."""
    import torch
    import torch.nn.functional as F

    rule = options.video
    assert rule is not None
    frames = np.stack([np.asarray(open_rgb(frame, url=url, key=key)) for frame in video.frames])
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # uint8 [n, 3, H, W]
    height, width = x.shape[-2:]
    h, w = rule.frame.resized(width, height)
    if (h, w) != (height, width):
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    mean = torch.tensor(options.image_mean, dtype=torch.float32) * (1.0 / options.rescale)
    std = torch.tensor(options.image_std, dtype=torch.float32) * (1.0 / options.rescale)
    x = x.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
    grid = rule.grid(len(video.frames), width, height)
    return Pixels(values=patchify_video(x.numpy(), rule.frame.patch_size, rule.frame.merge_size,
                                        rule.frame.temporal_patch_size), grid_thw=grid)


def patchify_video(frames: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """float32 ``[n, C, H, W]`` -> ``[t·gh·gw, C·tp·p·p]`` (``t = ceil(n / tp)``, the last frame
    repeated to fill the last temporal patch), patches in merge-window order."""
    n, c, height, width = frames.shape
    if pad := -n % temporal:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    t, gh, gw = frames.shape[0] // temporal, height // patch, width // patch
    patches = frames.reshape(t, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(t * gh * gw, c * temporal * patch * patch), dtype=np.float32)
