"""Where a jsonl image path may be read from: under ``MediaOptions.image_root``, and nowhere else (the rules:
``docs/multimodal.md``, "``image_root`` rules").

Containment is decided on the path percent-decoded until it no longer changes, since HTTP layers decode ``%2e%2e`` after
any check on the raw string, and an ``http(s)`` URL is also checked as ``yarl`` parses it. Cost per image: ~12-20 us of
string checks for a remote root; a local root adds one ``lstat`` per path component (~40 us for ``a/b/x.jpg``, about
what reading a 30 KB image costs).
"""

from __future__ import annotations

import functools
import os
import posixpath
import stat
from collections.abc import Callable
from urllib.parse import unquote

from streampack.errors import DataError
from streampack.io.storage import is_http, is_remote, local_path

_MAX_DECODES = 4  # "%25252e" needs three rounds to become "."; more than this is refused as hostile


def image_location(root: str | None, path: object, *, url: str, key: str) -> str:
    """The URL or local path to read image ``path`` of sample ``key`` from, under ``root``;
    raises ``DataError("bad_image")`` for a path that is not a non-empty string, names a
    location outside ``root``, or when ``root`` is None."""

    def refuse(why: str) -> DataError:
        return DataError("bad_image", f"image path {path!r} {why}", url=url, key=key, value=path)

    if not isinstance(path, str) or not path:
        raise refuse("is not a non-empty string")
    decoded = _decoded(path)
    if decoded is None:
        raise refuse("is percent-encoded too many times over to be checked against image_root")
    if decoded.count("/") != path.count("/") or decoded.count("\\") != path.count("\\"):
        # decoding made a separator (%2f, %5c, or %252f encoded twice): no store agrees on it
        raise refuse("holds an encoded separator (%2f or %5c); it must be relative and stay under image_root")
    if any(c < " " or c == "\x7f" for c in decoded):
        # a NUL ends a C path; URL parsers drop tab, CR and LF (".\n./x" becomes "../x" after every check on the string)
        raise refuse("holds a NUL or another control character (tab, newline...), raw or %-encoded; it must stay "
                     "under image_root")
    for form in (path, decoded):
        norm = posixpath.normpath(form)
        if form.startswith("/") or "://" in form or norm == ".." or norm.startswith("../") or norm == ".":
            # paths come from the data: they may not escape the root the user chose
            raise refuse("must be relative and stay under image_root")
    if root is None:
        raise refuse("is named by the record but MediaOptions.image_root is not set")
    norm = posixpath.normpath(path)
    if not is_remote(root):
        return _local(local_path(root), norm, refuse)
    if "\\" in decoded:
        raise refuse("holds a backslash, which some servers read as a separator; it must stay under image_root")
    where = root.rstrip("/") + "/" + norm
    if is_http(root) and not _http_under(root, where):
        raise refuse(f"resolves to {_http_path(where)!r}, outside image_root")
    return where


def _decoded(path: str) -> str | None:
    """``path`` percent-decoded until it stops changing; None past ``_MAX_DECODES`` rounds."""
    for _ in range(_MAX_DECODES):
        once = unquote(path)
        if once == path:
            return path
        path = once
    return None


def _http_path(url: str) -> str:
    import yarl

    return yarl.URL(url).path  # decoded and with dot segments resolved, as aiohttp will send it


def _http_under(root: str, where: str) -> bool:
    import yarl

    base, target = yarl.URL(root.rstrip("/") + "/"), yarl.URL(where)
    return (target.scheme, target.host, target.port) == (base.scheme, base.host, base.port) and \
        target.path.startswith(base.path) and target.path != base.path


def _local(root: str, norm: str, refuse: Callable[[str], DataError]) -> str:
    real_root = _real_root(root)
    target = os.path.join(real_root, norm)
    at, mode = real_root, 0
    for part in norm.split("/"):  # norm holds no "..": each component lies under the last
        at = os.path.join(at, part)
        try:
            mode = os.lstat(at).st_mode
        except OSError:
            return target  # missing: the open reports it as the read error it is
        if stat.S_ISLNK(mode):  # the path resolved, if it stays under the root
            target = os.path.realpath(target)
            if os.path.commonpath([real_root, target]) != real_root or target == real_root:
                raise refuse("leads out of image_root (through a symbolic link)")
            try:
                mode = os.stat(target).st_mode
            except OSError:
                return target
            break
    if not stat.S_ISREG(mode):
        raise refuse("is not a regular file")
    return target


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    # resolved once per process: realpath walks every component in Python (~10 us each, loaded box)
    return os.path.realpath(root)
