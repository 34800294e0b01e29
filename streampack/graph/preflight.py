"""Checks a ``PackedDataset`` runs once when it is built, so a typo fails in the first second, not hours in.

Cost per building process: one ``os.stat`` per local shard (~5 us: 20,000 shards in 0.10 s; remote
shards are not stat'ed) and the footer of each source's first parquet shard (two ranged requests
remotely). Under ``on_error="skip"`` nothing is refused, only logged.
"""

from __future__ import annotations

from streampack.io.decode import DecodeOptions
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList, missing_local
from streampack.logs import get_logger
from streampack.settings import ReadOptions

_LOG = get_logger(__name__)
_SHOWN = 5


def preflight(lists: list[ShardList], options: ReadOptions) -> None:
    """Every check above, for the shard lists of one dataset."""
    check_local_shards(lists, on_error=options.on_error)
    decode = DecodeOptions(tokens_key=options.tokens_key, text_key=options.text_key)
    check_parquet_schema(lists, decode, options.open_options(), on_error=options.on_error)


def check_local_shards(lists: list[ShardList], *, on_error: str) -> None:
    """Raise ``ValueError`` naming the missing local shards (the first few and how many)."""
    missing = [url for shards in lists for url in missing_local(shards.urls)]
    if not missing:
        return
    total = sum(len(shards) for shards in lists)
    shown = ", ".join(repr(u) for u in missing[:_SHOWN]) + (", ..." if len(missing) > _SHOWN else "")
    message = f"{len(missing)} of {total} shards do not exist: {shown}"
    if on_error == "raise":
        raise ValueError(message + " (check the brace range / glob; on_error='skip' reads the others)")
    _LOG.warning("%s (on_error='skip': they will be skipped as missing_shard)", message)


def check_parquet_schema(lists: list[ShardList], decode: DecodeOptions, opts: OpenOptions, *,
                         on_error: str) -> None:
    """Refuse a source whose first parquet shard's footer says its rows cannot decode
    (:func:`streampack.io.parquet.check_schema`): a column's type is the same in every row.
    Under ``on_error="skip"`` only logged (the readers skip and count those rows)."""
    from streampack.errors import DataError
    from streampack.io.open import open_shard
    from streampack.io.parquet import check_schema

    for shards in lists:
        # a suffix test, not shard_format: 4x cheaper (100 000 URLs: 0.17 s vs 0.68 s, loaded box)
        url = next((u for u in shards.urls if not u.startswith("pipe:") and u.split("?", 1)[0].endswith(".parquet")),
                   None)
        if url is None or url in missing_local([url]):
            continue
        try:
            with open_shard(url, opts=opts) as f:
                check_schema(f, decode, url)
        except DataError as e:
            if on_error == "raise":
                raise
            _LOG.warning("first parquet shard's schema: %s (on_error='skip': its rows will be skipped)", e)


__all__ = ["check_local_shards", "check_parquet_schema", "preflight"]
