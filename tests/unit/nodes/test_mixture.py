"""Weighted mixtures: Mixture (torchdata's MultiNodeWeightedSampler) save/load, proportions, and exact PackedDataset resume."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from node_checks import (
    ListSource,
    canon,
    check_save_load,
    drain,
    make_samples,
    roundtrip,
    write_token_shards,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack.dataset import PackedDataset
from streampack.nodes.mixture import CONFIG_KEY, Mixture
from streampack.nodes.reader import ShardReader
from streampack.options import PackOptions, ReadOptions
from streampack.options.topology import Placement
from streampack.plan.state import load_loader_state, record_of


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    web, _ = write_token_shards(root / "web", 160, 4, mean=90, seed=1)
    code, _ = write_token_shards(root / "code", 60, 2, mean=60, seed=2)
    return {"web": web, "code": code}


def _lists(sizes: dict[str, int]) -> dict[str, ListSource]:
    return {name: ListSource(make_samples([3] * n, seed=i)) for i, (name, n) in enumerate(sizes.items())}


# ------------------------------------------------------------------ node level
def test_node_save_load_over_lists() -> None:
    # finite children: with stop="first" the mixture ends when the first drawn child runs dry
    make = lambda: Mixture(_lists({"a": 40, "b": 30, "c": 20}), {"a": 2, "b": 1, "c": 1.5}, seed=3, stop="first")
    assert check_save_load(make) > 20
    # stop="all": every sample of every child exactly once
    node = Mixture(_lists({"a": 40, "b": 30, "c": 20}), {"a": 2, "b": 1, "c": 1.5}, seed=3, stop="all")
    assert check_save_load(lambda: Mixture(_lists({"a": 40, "b": 30, "c": 20}), {"a": 2, "b": 1, "c": 1.5},
                                           seed=3, stop="all")) == 90
    assert len(drain(node, 1000)) == 90


def test_node_save_load_over_shard_readers(sources) -> None:
    def make() -> Mixture:
        place = Placement(worker_id=1, num_workers=2)
        readers = {n: ShardReader(u, seed=4, epochs=2, place=place) for n, u in sources.items()}
        return Mixture(readers, {"web": 0.6, "code": 0.4}, seed=4, worker=1, num_workers=2)

    assert check_save_load(make) > 30


def test_node_infinite_resume_through_torch_save(sources) -> None:
    def make() -> Mixture:
        return Mixture({n: ShardReader(u, seed=5) for n, u in sources.items()}, {"web": 3, "code": 1}, seed=5)

    full = drain(make(), 700)  # several epochs of both sources
    node = make()
    head = drain(node, 333)
    state = roundtrip(node.state_dict())
    assert CONFIG_KEY in state and state[Mixture.NUM_YIELDED_KEY] == 333
    assert sum(c["drawn"] for c in state[Mixture.DATASET_NODE_STATES_KEY].values()) == 333
    restored = make()
    restored.reset(state)
    assert head + drain(restored, 700 - 333) == full


def test_node_proportions_follow_weights() -> None:
    weights = {"a": 0.6, "b": 0.3, "c": 0.1}
    node = Mixture(_lists(dict.fromkeys(weights, 5000)), weights, seed=11)
    n = 4000
    drain(node, n)
    drawn = node.metrics
    assert sum(drawn.values()) == n
    for name, w in weights.items():
        assert abs(drawn[name] / n - w) < 0.03, (name, drawn)


def test_node_worker_streams_differ_and_mapping_order_does_not_matter() -> None:
    weights = {"a": 1.0, "b": 1.0}
    keys = lambda node: [k for k, _, _ in drain(node, 200)]
    w0 = keys(Mixture(_lists({"a": 300, "b": 300}), weights, seed=1, worker=0, num_workers=2))
    w1 = keys(Mixture(_lists({"a": 300, "b": 300}), weights, seed=1, worker=1, num_workers=2))
    swapped = keys(Mixture(dict(reversed(_lists({"a": 300, "b": 300}).items())), {"b": 1.0, "a": 1.0},
                           seed=1, worker=0, num_workers=2))
    assert w0 != w1 and w0 == swapped


def test_node_refuses_other_config() -> None:
    node = Mixture(_lists({"a": 10, "b": 10}), {"a": 1, "b": 1}, seed=1)
    drain(node, 3)
    state = node.state_dict()
    other = Mixture(_lists({"a": 10, "b": 10}), {"a": 1, "b": 2}, seed=1)
    with pytest.raises(ValueError, match=r"weights: state=\[1.0, 1.0\] node=\[1.0, 2.0\]"):
        other.reset(state)


@pytest.mark.parametrize("weights", [{"a": 0, "b": 1}, {"a": -1, "b": 1}, {"a": math.nan, "b": 1},
                                     {"a": math.inf, "b": 1}, {"a": True, "b": 1}, {"a": "1", "b": 1}])
def test_node_refuses_bad_weights(weights) -> None:
    with pytest.raises(ValueError, match="positive finite") as e:
        Mixture(_lists({"a": 5, "b": 5}), weights)
    assert repr(weights["a"]) in str(e.value)


def test_node_refuses_mismatched_names() -> None:
    with pytest.raises(ValueError, match=r"\['a', 'c'\].*\['a', 'b'\]"):
        Mixture(_lists({"a": 5, "b": 5}), {"a": 1, "c": 1})


# ------------------------------------------------------------------ PackedDataset
def _ds(urls, **kw) -> PackedDataset:
    return PackedDataset(urls, **{"capacity": 256, "packs_per_batch": 2, "seed": 7,
                                  "packing": PackOptions(window=16, max_wait=3), **kw})


def _mix(sources, web: float = 0.7, code: float = 0.3) -> dict:
    return {"web": (sources["web"], web), "code": (sources["code"], code)}


def _take(it, n: int) -> list:
    return [canon(next(it)) for _ in range(n)]


def _interrupted(urls, num_workers: int, stops: list[int], total: int) -> list:
    out, state = [], None
    for start, stop in zip([0, *stops], [*stops, total]):
        loader = StatefulDataLoader(_ds(urls), batch_size=None, num_workers=num_workers)
        if state is not None:
            load_loader_state(loader, roundtrip(state))
        it = iter(loader)
        out += _take(it, stop - start)
        state = loader.state_dict()
        del it
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_resume_is_exact(sources, num_workers: int) -> None:
    total = 36  # several epochs of the small "code" source per worker
    full = _take(iter(StatefulDataLoader(_ds(_mix(sources)), batch_size=None, num_workers=num_workers)), total)
    assert _interrupted(_mix(sources), num_workers, [5, 17], total) == full


def test_dataset_mixes_both_sources_and_reports_draws(sources) -> None:
    ds = _ds(_mix(sources))
    it = iter(ds)
    batches = [next(it) for _ in range(20)]
    drawn = ds.metrics()["mixture"]
    assert set(drawn) == {"web", "code"} and drawn["web"] > drawn["code"] > 0
    dirs = Counter(k.split("#")[0].split("/")[-2] for b in batches for k in b.doc_keys)
    assert dirs["web"] > 0 and dirs["code"] > 0  # doc keys name each document's shard
    state = roundtrip(ds.state_dict())
    assert record_of(state["metrics"])["mixture"] == drawn
    restored = _ds(_mix(sources))
    restored.load_state_dict(state)
    iter(restored)
    assert restored.metrics()["mixture"] == drawn  # the restored graph has drawn as far


def test_dataset_accepts_bare_urls_with_weight_one(sources) -> None:
    ds = _ds({"web": sources["web"], "code": (sources["code"], 1)})
    assert ds.mixture_weights == {"code": 1.0, "web": 1.0}
    assert ds.urls == sources["code"] + sources["web"]


def test_fingerprint_refuses_changed_weights(sources) -> None:
    ds = _ds(_mix(sources))
    it = iter(ds)
    next(it)
    state = roundtrip(ds.state_dict())
    with pytest.raises(ValueError, match=r"mixture_weights: saved \{'code': 0.3, 'web': 0.7\}, "
                                         r"now \{'code': 0.5, 'web': 0.5\}"):
        _ds(_mix(sources, 0.5, 0.5)).load_state_dict(state)
    with pytest.raises(ValueError, match="mixture_sources"):
        _ds({"web": (sources["web"], 0.7), "code": (sources["code"][:1], 0.3)}).load_state_dict(state)
    with pytest.raises(ValueError, match="mixture_weights"):  # a plain dataset is not the mixture
        _ds(sources["web"] + sources["code"]).load_state_dict(state)
    _ds(dict(reversed(list(_mix(sources).items())))).load_state_dict(state)  # same mixture


def test_plain_urls_are_unchanged(sources) -> None:
    ds = _ds(sources["web"])
    next(iter(ds))
    assert ds.mixture is None and not any(k.startswith("mixture") for k in ds.fingerprint())
    assert "mixture" not in ds.metrics()


def test_dataset_refuses_bad_mixture_settings_and_weights(sources) -> None:
    with pytest.raises(ValueError, match=r"ReadOptions\(mixture_stop='sometimes'\): must be one of"):
        _ds(_mix(sources), epochs=2, read=ReadOptions(mixture_stop="sometimes"))
    with pytest.raises(ValueError, match=r"positive finite.*'code': -0.3"):
        _ds(_mix(sources, code=-0.3))
    with pytest.raises(ValueError, match="at least one source"):
        _ds({})

