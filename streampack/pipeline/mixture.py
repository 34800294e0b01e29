"""Deprecated alias of :mod:`streampack.nodes.mixture` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.nodes.mixture": ("check_weights", "CONFIG_KEY", "DRAWN_KEY"),
    "streampack.state": ("STATE_VERSION", "VERSION_KEY"),
}, gone={
    "MixtureNode": ("replaced by streampack.nodes.mixture.Mixture (torchdata's MultiNodeWeightedSampler), "
                    "whose constructor and state differ"),
    "RNG_KEY": "the mixture state is torchdata's MultiNodeWeightedSampler's now",
    "SOURCES_KEY": "the mixture state is torchdata's MultiNodeWeightedSampler's now",
    "EXHAUSTED_KEY": "the mixture state is torchdata's MultiNodeWeightedSampler's now",
})
