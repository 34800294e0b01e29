"""Deprecated: the old reading stages, moved to :mod:`streampack.io` (bytes and formats) and
:mod:`streampack.nodes` (one node per file). Each ``streampack.pipeline.<module>`` is an alias
that warns (:mod:`streampack._moved`); this package itself holds nothing."""
