"""Training on packed batches follows the same loss curve as training on padded batches of the
same documents (same init, same order, token-mean loss over the whole step), in float64."""

from __future__ import annotations

import copy
import importlib.util
import random
from pathlib import Path

import helpers_layouts as layouts
import pytest
import torch
import torch.nn.functional as F

from streampack import PackedBatch
from streampack.attention import global_num_targets, packed_cross_entropy

ROOT = Path(__file__).resolve().parents[3]
VOCAB, STEPS, DOCS_PER_STEP = 64, 20, 6


def load_tiny_gpt():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("tiny_gpt", ROOT / "examples" / "tiny_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_steps(seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    steps = []
    for _ in range(STEPS):
        docs = []
        for i in range(DOCS_PER_STEP):
            n, start, stride = rng.randint(2, 14), rng.randrange(VOCAB), rng.randint(1, 3)
            doc = {"input_ids": [(start + j * stride) % VOCAB for j in range(n)]}  # learnable
            if i == 1:  # a prompt/completion document: loss on the second half only
                doc["loss_mask"] = [0] * (n // 2) + [1] * (n - n // 2)
            docs.append(doc)
        steps.append(docs)
    return steps


def greedy_pack(docs: list[dict], capacity: int, align: int) -> PackedBatch:
    return layouts.greedy_pack(docs, capacity, align)


def padded_loss(model: torch.nn.Module, docs: list[dict]) -> torch.Tensor:
    S = max(len(d["input_ids"]) for d in docs)
    ids = torch.zeros(len(docs), S, dtype=torch.long)
    mask = torch.zeros(len(docs), S, dtype=torch.bool)
    labels = torch.full((len(docs), S), -100)
    for i, d in enumerate(docs):
        x = torch.tensor(d["input_ids"])
        keep = torch.tensor(d.get("loss_mask", [1] * len(x))).bool()
        ids[i, :len(x)], mask[i, :len(x)] = x, True
        labels[i, :len(x) - 1] = torch.where(keep[1:], x[1:], -100)
    logits = model(ids, attention_mask=mask)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def packed_step_loss(model: torch.nn.Module, docs: list[dict], tiny) -> torch.Tensor:  # noqa: ANN001
    # two micro-batches per step, normalised by the step's total targets
    micro = [greedy_pack(docs[:2], capacity=16, align=4), greedy_pack(docs[2:], capacity=16, align=4)]
    n = global_num_targets(micro)
    return sum(packed_cross_entropy(tiny.packed_forward(model, b), b, num_targets=n).loss
               for b in micro)


def train(model: torch.nn.Module, steps: list[list[dict]], loss_fn) -> list[float]:  # noqa: ANN001
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    curve = []
    for docs in steps:
        opt.zero_grad()
        loss = loss_fn(model, docs)
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
    return curve


@pytest.mark.slow  # 20 training steps of two models: integration
def test_packed_and_padded_training_follow_the_same_loss_curve() -> None:
    tiny = load_tiny_gpt()
    torch.manual_seed(0)
    base = tiny.TinyGPT(VOCAB, 32, 2, 4, max_len=64).double()
    steps = make_steps()
    padded_model, packed_model = copy.deepcopy(base), copy.deepcopy(base)
    padded = train(padded_model, steps, padded_loss)
    packed = train(packed_model, steps, lambda m, d: packed_step_loss(m, d, tiny))
    assert padded[-1] < padded[0] - 0.1, "the model did not learn: the comparison is vacuous"
    for step, (a, b) in enumerate(zip(padded, packed)):
        assert abs(a - b) < 1e-9 * max(1.0, abs(a)), f"step {step}: padded {a} vs packed {b}"
    for (name, p), q in zip(padded_model.named_parameters(), packed_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=1e-9, msg=name)


def test_tiny_gpt_shapes_and_errors() -> None:
    tiny = load_tiny_gpt()
    model = tiny.TinyGPT(VOCAB, 16, 1, 2, max_len=32)
    batch = greedy_pack(make_steps()[0], capacity=16, align=2)
    assert tiny.packed_forward(model, batch).shape == (batch.total_tokens, VOCAB)
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, VOCAB)
    try:
        model(batch.input_ids[None], packed=batch)
    except ValueError as err:
        assert "[T]" in str(err)
    else:
        raise AssertionError("a [1, T] packed input was accepted")
