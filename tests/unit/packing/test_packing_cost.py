"""``CostModel``: hand-computed costs, and the FLOP formula against torch's FLOP counter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from streampack.packing import CostModel, pack_flat


def test_costs_by_hand() -> None:
    model = CostModel(linear=2.0, attention=3.0)
    assert model.pack_cost([1, 2]) == 2 * 3 + 3 * (1 + 4)
    assert model.pack_cost(np.array([1, 2]), padded_to=10) == 2 * 10 + 3 * 5  # padding: linear only
    assert model.pack_cost([]) == 0.0
    with pytest.raises(ValueError, match="3 tokens > padded_to=2"):
        model.pack_cost([1, 2], padded_to=2)
    # one 8-token document costs more than two of 4 in the same number of tokens
    assert model.pack_cost([8]) - model.pack_cost([4, 4]) == 3.0 * (64 - 32)


def test_vectorised_costs_match_one_pack_at_a_time() -> None:
    model = CostModel.from_shape(hidden=64, layers=2, heads=4, ffn=256, vocab=100)
    lengths = np.random.default_rng(0).integers(1, 300, 400)
    result = pack_flat(lengths, 512, "bfd")
    costs = model.pack_costs(result, lengths)
    one_by_one = [model.pack_cost(lengths[b]) for b in result.bins()]
    assert costs.shape == (result.num_bins,) and np.allclose(costs, one_by_one, rtol=1e-12)
    padded = model.pack_costs(result, lengths, padded_to=512)
    assert np.allclose(padded, [model.pack_cost(lengths[b], padded_to=512) for b in result.bins()])
    assert model.batch_cost(result, lengths) == pytest.approx(sum(one_by_one), rel=1e-12)
    with pytest.raises(ValueError, match="padded_to=100"):
        model.pack_costs(result, lengths, padded_to=100)


def test_formula_by_hand() -> None:
    # h=8, kv = 1 head of 4, f=12, gated: per layer 4·64 + 4·8·4 + 6·8·12 + 2·8 = 976
    model = CostModel.from_shape(hidden=8, layers=2, heads=2, kv_heads=1, ffn=12, vocab=10,
                                 training=False)
    assert (model.linear, model.attention) == (2 * 976 + 2 * 8 * 10, 2 * 8 * 2)
    plain = CostModel.from_shape(hidden=8, layers=2, heads=2, ffn=12, gated=False)
    assert plain.linear == 3 * 2 * (4 * 64 + 4 * 64 + 4 * 8 * 12 + 2 * 8)
    assert plain.attention == 3 * 2 * 8 * 2


def _counted_flops(length: int, *, backward: bool) -> int:
    """FLOPs torch counts for a tiny decoder (h=8, 2 heads, 1 KV head, gated FFN 12, 2 layers,
    vocab 10) on one document, with causal attention done row by row so that query i
    multiplies exactly i + 1 keys, as a mask-skipping kernel does."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(0)
    h, heads, d, f = 8, 2, 4, 12

    def w(a: int, b: int) -> torch.Tensor:
        return (torch.randn(a, b, generator=gen) * 0.1).requires_grad_()

    x = torch.randn(length, h, generator=gen, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        for _ in range(2):
            q = (x @ w(h, h)).view(length, heads, d).transpose(0, 1)
            k = (x @ w(h, d)).view(length, 1, d).transpose(0, 1).expand(heads, length, d)
            v = (x @ w(h, d)).view(length, 1, d).transpose(0, 1).expand(heads, length, d)
            rows = [torch.softmax(q[:, i:i + 1] @ k[:, :i + 1].transpose(1, 2), -1) @ v[:, :i + 1]
                    for i in range(length)]
            x = x + torch.cat(rows, 1).transpose(0, 1).reshape(length, h) @ w(h, h)
            x = x + (torch.nn.functional.silu(x @ w(h, f)) * (x @ w(h, f))) @ w(f, h)
        logits = x @ w(h, 10)
        if backward:
            logits.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("length", [1, 5, 9])
@pytest.mark.parametrize("training", [False, True])
def test_formula_matches_counted_flops(length: int, training: bool) -> None:
    model = CostModel.from_shape(hidden=8, layers=2, heads=2, kv_heads=1, ffn=12, vocab=10,
                                 training=training)
    assert model.pack_cost([length]) == _counted_flops(length, backward=training)


def test_record_and_validation() -> None:
    model = CostModel(linear=1.0, attention=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.linear = 2.0  # type: ignore[misc]
    assert not hasattr(model, "__dict__")
    with pytest.raises(TypeError):
        CostModel(1.0, 0.5)  # type: ignore[misc]  # keyword-only
    with pytest.raises(ValueError, match="coefficients must be >= 0"):
        CostModel(linear=-1.0, attention=0.0)
    with pytest.raises(ValueError, match="heads dividing hidden"):
        CostModel.from_shape(hidden=10, layers=1, heads=3, ffn=4)
    with pytest.raises(ValueError, match="layers=0"):
        CostModel.from_shape(hidden=8, layers=0, heads=2, ffn=4)
