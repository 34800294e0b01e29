"""MixtureNode: a weighted mixture of named sample sources (one ShardReader per source).

Each ``next()`` draws a source with probability proportional to its weight, from a numpy
Generator seeded by ``(seed, worker)``, and returns that source's next sample. The draw is one
``rng.random()`` against the cumulative weights (sources sorted by name, so the order of the
mapping does not matter), so the stream is a pure function of the rng state and the children's
positions — both of which are in the state, so a restore continues bit-identically without
replaying anything.

Meant for infinite children (``ShardReader(epochs=None)`` cycles and reshuffles per epoch).
Should a child end anyway, the mixture ends with it, and stays ended in its state: where a
finite mixture should stop (first source dry? all of them? renormalize?) is a policy question
with no neutral answer, so ``PackedDataset`` only builds infinite mixtures.

State (plain data; the PCG64 state's 128-bit ints survive ``torch.load(weights_only=True)``)::

    {"version": 1,
     "config": {"names": ["code", "web"], "weights": [0.3, 0.7], "seed": s, "worker": g},
     "rng": {"bit_generator": "PCG64", "state": {"state": int, "inc": int}, ...},
     "sources": {"code": <child state>, "web": <child state>},
     "drawn": {"code": n_code, "web": n_web},   # samples returned per source (metrics)
     "exhausted": None}                          # name of the child that ended, if one did

Restoring a state whose ``config`` differs raises ``ValueError`` naming both values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.sample import Sample
from streampack.state import check_node_config

STATE_VERSION = 1
VERSION_KEY = "version"
CONFIG_KEY = "config"
RNG_KEY = "rng"
SOURCES_KEY = "sources"
DRAWN_KEY = "drawn"
EXHAUSTED_KEY = "exhausted"

_STREAM_TAG = 0x6D6978  # "mix": keeps this rng apart from others seeded by (seed, worker)


def check_weights(names: Any, weights: Mapping[str, Any]) -> dict[str, float]:
    """``weights`` as ``{name: float}`` after checking its names and values (ValueError if bad)."""
    names = sorted(names)
    if not names:
        raise ValueError("a mixture needs at least one source")
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"mixture source names must be non-empty strings, got {names!r}")
    if sorted(weights) != names:
        raise ValueError(f"mixture weights are for sources {sorted(weights)!r}, the sources are {names!r}")
    bad = {n: w for n, w in weights.items()
           if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(w) or w <= 0}
    if bad:
        raise ValueError(f"mixture weights must be positive finite numbers, got {bad!r}")
    return {n: float(weights[n]) for n in names}


class MixtureNode(BaseNode[Sample]):
    """Samples from ``sources`` (name -> node), each drawn with probability ``weight / sum``."""

    def __init__(self, sources: Mapping[str, BaseNode[Sample]], weights: Mapping[str, float], *,
                 seed: int = 0, worker: int = 0) -> None:
        super().__init__()
        self.weights = check_weights(sources, weights)
        self.names = list(self.weights)
        self.sources = {n: sources[n] for n in self.names}
        total = sum(self.weights.values())
        self._cdf = np.cumsum([w / total for w in self.weights.values()])
        self._cdf[-1] = 1.0  # rounding must not leave a gap above the last source
        self._seed = np.random.SeedSequence([seed, worker, _STREAM_TAG])
        self._config = {"names": self.names, "weights": list(self.weights.values()),
                        "seed": seed, "worker": worker}
        self._rng = np.random.default_rng(self._seed)
        self._drawn = dict.fromkeys(self.names, 0)
        self._exhausted: str | None = None

    @property
    def metrics(self) -> dict[str, int]:
        """Samples returned so far per source."""
        return dict(self._drawn)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            for child in self.sources.values():
                child.reset(None)
            self._rng = np.random.default_rng(self._seed)
            self._drawn = dict.fromkeys(self.names, 0)
            self._exhausted = None
            return
        if initial_state.get(VERSION_KEY) != STATE_VERSION:
            raise ValueError(f"MixtureNode state version {initial_state.get(VERSION_KEY)!r} != {STATE_VERSION}")
        check_node_config(initial_state.get(CONFIG_KEY, {}), self._config, node="MixtureNode", label="node")
        for name, child in self.sources.items():
            child.reset(initial_state[SOURCES_KEY][name])
        self._rng = np.random.default_rng(self._seed)
        self._rng.bit_generator.state = initial_state[RNG_KEY]
        self._drawn = {n: int(initial_state[DRAWN_KEY][n]) for n in self.names}
        self._exhausted = initial_state[EXHAUSTED_KEY]

    def next(self) -> Sample:
        if self._exhausted is not None:
            raise StopIteration
        name = self.names[int(np.searchsorted(self._cdf, self._rng.random(), side="right"))]
        try:
            sample = next(self.sources[name])
        except StopIteration:
            self._exhausted = name
            raise
        self._drawn[name] += 1
        return sample

    def get_state(self) -> dict[str, Any]:
        return {
            VERSION_KEY: STATE_VERSION,
            CONFIG_KEY: dict(self._config, names=list(self.names), weights=list(self._config["weights"])),
            RNG_KEY: _plain(self._rng.bit_generator.state),
            SOURCES_KEY: {n: child.state_dict() for n, child in self.sources.items()},
            DRAWN_KEY: dict(self._drawn),
            EXHAUSTED_KEY: self._exhausted,
        }


def _plain(value: Any) -> Any:
    """The bit generator's state as builtin dicts / ints / strings (no numpy scalars)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.integer):
        return int(value)
    return value
