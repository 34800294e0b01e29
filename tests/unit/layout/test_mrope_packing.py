"""VLM-style 3-D (mRoPE-like) positions survive packing (LF#7754, areal#217): a model that
reads per-token 3-D positions from ``batch.extras`` gives the same outputs packed as alone."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from streampack import Sample, pack_batch
from streampack.attention import sdpa_packed, unpack_per_document


def mrope_positions(n_text: int, grid: tuple[int, int], n_after: int) -> np.ndarray:
    """Text, then an image of ``grid`` patches at one temporal step, then text: ``[L, 3]``."""
    t = np.arange(n_text)
    text = np.stack([t, t, t], 1)
    h, w = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij")
    image = np.stack([np.full(h.size, n_text), n_text + h.ravel(), n_text + w.ravel()], 1)
    start = n_text + max(grid)
    after = np.arange(start, start + n_after)
    return np.concatenate([text, image, np.stack([after, after, after], 1)]).astype(np.int64)


class Tiny3D(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, max_pos: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.ModuleList(nn.Embedding(max_pos, dim) for _ in range(3))
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, ids: torch.Tensor, pos3: torch.Tensor, batch) -> torch.Tensor:
        x = self.tok(ids) + sum(emb(pos3[:, k]) for k, emb in enumerate(self.pos))
        q, k, v = self.qkv(x).view(-1, 3, 2, x.shape[-1] // 2).unbind(1)  # [T, heads=2, d]
        return sdpa_packed(q, k, v, batch)


def test_packed_3d_positions_equal_each_document_alone():
    rng = np.random.default_rng(0)
    shapes = [(3, (2, 2), 2), (1, (3, 2), 4), (5, (1, 1), 0), (2, (2, 3), 1)]
    docs = []
    for i, (a, grid, b) in enumerate(shapes):
        pos = mrope_positions(a, grid, b)
        docs.append(Sample(key=f"d{i}", tokens=rng.integers(1, 50, len(pos)), extras={"mrope": pos}))
    torch.manual_seed(0)
    model = Tiny3D().eval()
    batch = pack_batch([docs[:2], docs[2:]], capacity=24, align=4)
    assert batch.extras["mrope"].shape == (48, 3)
    with torch.no_grad():
        packed = unpack_per_document(model(batch.input_ids, batch.extras["mrope"], batch), batch)
        for doc, got in zip(docs, packed):
            alone = pack_batch([[doc]], capacity=24, align=4)
            want = model(alone.input_ids, alone.extras["mrope"], alone)[: len(doc)]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # positions restart per document in the text axis too (not continued from the previous doc)
    starts = batch.cu_seqlens_padded[:-1].long()
    assert batch.extras["mrope"][starts].abs().sum() == 0
