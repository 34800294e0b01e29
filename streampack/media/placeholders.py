"""Image placeholders: each image's single placeholder token becomes its rule's count of tokens.

A sample's text holds one ``image_token_id`` per image, in image order (Qwen2-VL's ``<|image_pad|>``, LLaVA's
``<image>``); :func:`expand_placeholders` repeats each to the image's token count as the HF processors do, with loss
mask 0. An already-expanded sample passes unchanged; any other count is ``image_placeholder_mismatch``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streampack.errors import DataError
from streampack.sample import Sample


def image_starts(tokens: np.ndarray, image_token_id: int, counts: Sequence[int]) -> np.ndarray | None:
    """int64 ``[n_images]``: where each image's tokens start when the placeholders of ``tokens``
    are exactly ``counts[k]`` contiguous tokens per image, in order (two images with no text
    between them are two runs cut by their counts); None otherwise."""
    want = np.asarray(counts, dtype=np.int64)
    where = np.flatnonzero(tokens == image_token_id)
    if where.size != int(want.sum()):
        return None
    ends = np.cumsum(want)
    first, last = where[ends - want], where[ends - 1]
    return first.astype(np.int64) if np.array_equal(last - first, want - 1) else None


def expand_placeholders(sample: Sample, counts: Sequence[int], image_token_id: int, *, kind: str = "image") -> Sample:
    """``sample`` with every image placeholder repeated to its image's token count; labels, loss mask and extras follow
    (extras repeat the placeholder's row). ``kind`` (``"video"``) names what the placeholders stand for in the error."""
    assert sample.tokens is not None, "expand after tokenizing"
    tokens = sample.tokens
    where = np.flatnonzero(tokens == image_token_id)
    want = np.asarray(counts, dtype=np.int64)
    if where.size == len(want):
        reps = np.ones(tokens.shape[0], dtype=np.int64)
        reps[where] = want
    elif image_starts(tokens, image_token_id, want) is not None:
        reps = None  # already expanded
    else:
        raise DataError(f"{kind}_placeholder_mismatch", f"{where.size} {kind} tokens (id {image_token_id}) for "
                        f"{len(want)} {kind}s needing {want.tolist()} tokens: want one placeholder per {kind}",
                        url=sample.url, key=sample.key, value=where.size)
    if reps is not None:
        tokens = np.repeat(tokens, reps)
    image = tokens == image_token_id
    mask = np.ones(tokens.shape[0], dtype=bool) if sample.loss_mask is None else sample.loss_mask.astype(bool)
    labels, extras = sample.labels, sample.extras
    if reps is not None:
        mask = np.repeat(mask, reps) if sample.loss_mask is not None else mask
        labels = None if labels is None else np.repeat(labels, reps)
        extras = {k: np.repeat(v, reps, axis=0) for k, v in extras.items()}
    return sample.evolve(tokens=tokens, labels=labels, loss_mask=mask & ~image, extras=extras)
