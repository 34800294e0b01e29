"""Deprecated alias of :mod:`streampack.io.storage` (see :mod:`streampack._moved`)."""

from streampack._moved import alias

__getattr__, __all__ = alias(__name__, {
    "streampack.io.storage": ("ENDPOINT_ENV",),
}, gone={
    **{name: ("s3:// URLs are read through fsspec (s3fs): streampack.io.open.open_shard opens any URL, "
              "streampack.io.storage.identity gives its size and ETag")
       for name in ("S3_PREFIX", "LIST_PAGE_SIZE", "is_s3", "split_url", "open_object", "fingerprint",
                    "list_prefix")},
})
