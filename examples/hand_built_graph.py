"""Build streampack's graph yourself, with torchdata's own nodes in between, and checkpoint it
through ``torchdata.nodes.Loader`` — exactly, like ``PackedDataset``.

Two ways, both checked against ``PackedDataset`` batch for batch:

1. by hand, node by node: streampack's reader, tokenizer, overlong policy, window packer and
   THD collate, with torchdata's ``ParallelMapper`` (threads) tokenizing and ``Prefetcher`` /
   ``PinMemory`` in front of the loop;
2. with the one graph builder ``PackedDataset`` itself uses (``streampack.graph.build.build_graph``),
   wrapping named stages with torchdata nodes through ``around=``.

Run: ``python examples/hand_built_graph.py`` (writes a small text corpus to a temp dir).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torchdata.nodes import Loader, ParallelMapper, PinMemory, Prefetcher

from streampack import PackedDataset
from streampack.graph.build import Placement, Sources, StreamConfig, build_graph
from streampack.io.urls import ShardList
from streampack.nodes import OverlongNode, ShardReader, TextEncoder, ThdCollate, WindowPacker
from streampack.options import PackOptions, TokenizeOptions
from streampack.packing.window_rounds import worker_seed

CAPACITY, WINDOW, SEED, EOS = 512, 64, 3, 0


def config() -> StreamConfig:
    """Every setting, as the option records ``PackedDataset`` takes: each value is checked here, once."""
    return StreamConfig(capacity=CAPACITY, packs_per_batch=2, seed=SEED, tokenize=TokenizeOptions(eos_id=EOS),
                        packing=PackOptions(window=WINDOW))


def by_hand(urls: list[str], tokenizer: str) -> Loader:
    c = config()                                     # each node takes its stage's record
    shards = ShardList.of(urls)                      # expand once: workers and restores reuse it
    node = ShardReader(shards, seed=c.seed, read=c.read)  # infinite, reshuffled per epoch; rank 0 of 1
    node = ParallelMapper(node, map_fn=TextEncoder(tokenizer, c.tokenize), num_workers=2,
                          method="thread", in_order=True)  # torchdata's thread pool tokenizes
    node = OverlongNode(node, c.capacity, c.packing.overlong)
    node = WindowPacker(node, rules=c.packer_rules(worker_seed(c.seed, 0)))  # reader 0's packing seed
    node = ThdCollate(node, layout=c.batch_layout())
    node = Prefetcher(node, prefetch_factor=4)
    if torch.cuda.is_available():
        node = PinMemory(node)
    return Loader(node)


def with_builder(urls: list[str], tokenizer: str) -> Loader:
    graph = build_graph(config(), Sources(shards=ShardList.of(urls)), Placement(), tokenizer=tokenizer,
                        around={"tokenize": lambda n: Prefetcher(n, 16), "collate": lambda n: Prefetcher(n, 4)})
    return Loader(graph.root)


def reference(urls: list[str], tokenizer: str) -> PackedDataset:
    return PackedDataset(urls, capacity=CAPACITY, packs_per_batch=2, seed=SEED, tokenizer=tokenizer,
                         tokenize=TokenizeOptions(eos_id=EOS), packing=PackOptions(window=WINDOW))


def take(iterator, n: int) -> list[tuple]:
    return [(b.doc_keys, b.input_ids.tolist(), b.labels.tolist(), b.cu_seqlens_padded.tolist())
            for _, b in zip(range(n), iterator)]


def close(loader: Loader) -> None:
    """Stop torchdata's thread-backed iterators before the interpreter exits.

    ``ParallelMapper`` and ``Prefetcher`` run daemon threads that torchdata joins only from
    ``__del__``; left to interpreter shutdown, a thread still inside the tokenizer can abort the
    process ("terminate called without an active exception", 1 run in 6 here).
    """
    seen, todo = set(), [loader.root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if callable(getattr(obj, "_shutdown", None)):
            obj._shutdown()
        todo.extend(v for v in getattr(obj, "__dict__", {}).values()   # the graph's own nodes and iterators
                    if type(v).__module__.startswith(("torchdata.", "streampack.")))


def check(urls: list[str], tokenizer: str, steps: int, save_at: int) -> dict[str, bool]:
    """Each way equals PackedDataset, and resumes exactly from ``Loader.state_dict()``."""
    want = take(iter(reference(urls, tokenizer)), steps)
    result = {}
    for name, make in (("by_hand", by_hand), ("with_builder", with_builder)):
        loader = make(urls, tokenizer)
        it = iter(loader)
        head = take(it, save_at)
        state = loader.state_dict()
        fresh = make(urls, tokenizer)
        fresh.load_state_dict(state)
        tail = take(iter(fresh), steps - save_at)
        close(loader)
        close(fresh)
        result[name] = head + tail == want
    return result


def main() -> int:
    from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-at", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_demo_corpus(Path(tmp) / "corpus", num_shards=2, docs_per_shard=120, vocab_size=800)
        tokenizer = str(train_demo_tokenizer(urls, Path(tmp) / "tokenizer.json", vocab_size=600))
        result = check(urls, tokenizer, args.steps, args.save_at)
    for name, ok in result.items():
        print(f"{name}: equals PackedDataset and resumes exactly from Loader.state_dict(): {ok}")
    return 0 if all(result.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
