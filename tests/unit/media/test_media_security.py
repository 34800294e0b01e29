"""Nothing outside ``MediaOptions.image_root`` is ever read, an error never shows the bytes of a
file that is not what it should be, and tar images sit on their own placeholders. Each through
``PackedDataset`` (plus unit checks), with a loopback HTTP server that records every path
requested (``tests/helpers_faults.py``)."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from streampack import PackedDataset
from streampack.errors import DataError
from streampack.media import DynamicResolution, FixedTokens, MediaOptions
from streampack.options import ReadOptions
from tests.helpers_faults import serve_faulty
from tests.helpers_media import IMAGE_ID, add_member, image_bytes, sample_ids

FIXED = FixedTokens(size=28, tokens=4)
SECRET = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"


def write_jsonl(path: Path, paths: list[str]) -> str:
    """One sample per image path, each with one placeholder."""
    rng = np.random.default_rng(0)
    lines = [json.dumps({"input_ids": sample_ids(rng, 1, 6), "images": [p]}) for p in paths]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def dataset(url: str, root: str, **kw) -> PackedDataset:
    media = MediaOptions(rule=FIXED, image_token_id=IMAGE_ID, image_root=root)
    return PackedDataset([url], capacity=64, epochs=1, shuffle=False, media=media, **kw)


def images_trained(ds: PackedDataset) -> int:
    return sum(b.vision.num_images for b in ds if b.vision is not None)


def assert_refused(url: str, root: str, *, bad_key: str, good: int, reason: str = "bad_image") -> DataError:
    """Under ``skip`` the bad sample is dropped and counted, its neighbours kept; under ``raise``
    it is a DataError naming shard and key. Returns that error."""
    ds = dataset(url, root, read=ReadOptions(on_error="skip"))
    assert images_trained(ds) == good
    assert ds.metrics()["errors"]["counts"] == {reason: 1}
    with pytest.raises(DataError) as e:
        list(dataset(url, root))
    assert e.value.reason == reason and e.value.key == bad_key and e.value.url == url
    return e.value


def web_root(tmp_path: Path) -> Path:
    """``www/images/{0,1}.png`` (the root) and ``www/secret.png`` / ``www/images_x/s.png``
    (outside it, valid images: a reader that reached them would train them)."""
    www = tmp_path / "www"
    (www / "images" / "sub").mkdir(parents=True)
    (www / "images_x").mkdir()
    for i in range(2):
        (www / "images" / f"{i}.png").write_bytes(image_bytes(30, 20, seed=i))
    (www / "secret.png").write_bytes(image_bytes(30, 20, seed=7))
    (www / "images_x" / "s.png").write_bytes(image_bytes(30, 20, seed=8))
    return www


@pytest.mark.parametrize("path", ["%2e%2e/secret.png", "sub/%2e%2e/%2e%2e/secret.png", "%2E%2E/secret.png",
                                  ".%2e/secret.png", "sub/..%2f..%2fsecret.png", "..%5csecret.png",
                                  "%2e%2e/images_x/s.png", "sub%2f%2e%2e%2f%2e%2e%2fsecret.png",
                                  ".\n./secret.png", "sub/.\t./.\r./secret.png", "%2e%0a%2e/secret.png"])
def test_encoded_dot_segments_never_leave_an_http_image_root(tmp_path: Path, path: str) -> None:
    # finding: "%2e%2e/secret.png" passed the root check (normalised before the URL layer decoded
    # it) and the reader fetched and trained /secret.png
    www = web_root(tmp_path)
    url = write_jsonl(tmp_path / "a.jsonl", ["0.png", path, "1.png"])
    with serve_faulty(www) as server:
        root = server.url + "/images"
        err = assert_refused(url, root, bad_key="1", good=2)
        assert "image_root" in str(err)
        requested = [r.path for r in server.requests]
        assert requested and all(p.startswith("/images/") for p in requested), requested


def test_image_urls_inside_an_http_root_still_read(tmp_path: Path) -> None:
    # the check refuses escapes, not ordinary names: dots inside a name, a "./" and a resolved ".."
    www = web_root(tmp_path)
    (www / "images" / "sub" / "a..b.png").write_bytes(image_bytes(30, 20, seed=3))
    url = write_jsonl(tmp_path / "a.jsonl", ["./0.png", "sub/../1.png", "sub/a..b.png"])
    with serve_faulty(www) as server:
        ds = dataset(url, server.url + "/images")
        assert images_trained(ds) == 3
        assert sorted({r.path for r in server.gets()}) == ["/images/0.png", "/images/1.png", "/images/sub/a..b.png"]


@pytest.mark.parametrize("root", ["memory://bucket/images", "s3://bucket/images", "file:///data/images"])
@pytest.mark.parametrize("path", ["%2e%2e/secret.png", "a/%2E%2E/%2e%2e/secret.png", "a%2fb.png", "a%5Cb.png",
                                  "%252e%252e/secret.png", "a%252fb.png", "%25252525252e", "a\x00.png", "a%00.png",
                                  "a%2500.png", "a%09.png"])
def test_encoded_escapes_are_refused_for_every_protocol_before_any_read(root: str, path: str) -> None:
    media = MediaOptions(rule=FIXED, image_token_id=IMAGE_ID, image_root=root)
    with pytest.raises(DataError, match="image_root") as e:
        media.reading()._path(path, media_limits(), url="shard.jsonl", key="k")
    assert e.value.reason == "bad_image" and e.value.key == "k"


def test_the_http_check_reads_the_url_as_the_http_layer_sends_it() -> None:
    # the second line behind the string checks: yarl drops tab / CR / LF and resolves dot segments
    from streampack.media.paths import _http_under

    root = "http://127.0.0.1:8000/images"
    assert _http_under(root, root + "/sub/a.png") and _http_under(root, root + "/sub/../a.png?x=1")
    assert not _http_under(root, root + "/.\n./secret.png")
    assert not _http_under(root, root + "/%2e%2e/images_x/s.png")
    assert not _http_under(root, "http://127.0.0.1:8001/images/a.png")
    assert not _http_under(root, root)


def media_limits():
    from streampack.io.limits import Limits

    return Limits()


def local_root(tmp_path: Path) -> tuple[Path, Path]:
    """``root/{0,1}.png`` and ``outside/x.png`` (a valid image), side by side."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    for i in range(2):
        (root / f"{i}.png").write_bytes(image_bytes(30, 20, seed=i))
    (outside / "x.png").write_bytes(image_bytes(30, 20, seed=9))
    return root, outside


@pytest.mark.parametrize("link", ["file", "dir"])
def test_symlinks_out_of_a_local_image_root_are_refused(tmp_path: Path, link: str) -> None:
    # finding: root/sub/link.png -> ../outside/x.png and a symlinked directory were both trained
    root, outside = local_root(tmp_path)
    if link == "file":
        os.symlink(outside / "x.png", root / "sub" / "link.png")
        bad = "sub/link.png"
    else:
        os.symlink(outside, root / "linked")
        bad = "linked/x.png"
    url = write_jsonl(tmp_path / "a.jsonl", ["0.png", bad, "1.png"])
    err = assert_refused(url, str(root), bad_key="1", good=2)
    assert "image_root" in str(err)


def test_symlinks_inside_a_local_image_root_and_a_symlinked_root_still_read(tmp_path: Path) -> None:
    root, _ = local_root(tmp_path)
    os.symlink(root / "0.png", root / "sub" / "same.png")  # resolves inside the root
    os.symlink(root, tmp_path / "root_link")  # the root itself behind a link (a mounted data dir)
    url = write_jsonl(tmp_path / "a.jsonl", ["0.png", "sub/same.png", "1.png"])
    assert images_trained(dataset(url, str(root))) == 3
    assert images_trained(dataset(url, str(tmp_path / "root_link"))) == 3


def test_a_file_that_is_not_an_image_is_named_never_shown(tmp_path: Path) -> None:
    # finding: root/a.png holding /etc/passwd's lines was refused with value=b'root:x:0:0:root:'
    # in the exception, the logs and metrics()["errors"]
    root, outside = local_root(tmp_path)
    (root / "a.png").write_bytes(SECRET)
    (outside / "passwd").write_bytes(SECRET)
    os.symlink(outside / "passwd", root / "p.png")
    for bad in ("a.png", "p.png"):
        url = write_jsonl(tmp_path / f"{bad}.jsonl", ["0.png", bad, "1.png"])
        ds = dataset(url, str(root), read=ReadOptions(on_error="skip"))
        assert images_trained(ds) == 2
        errors = ds.metrics()["errors"]
        assert errors["counts"] == {"bad_image": 1}
        assert bad in errors["recent"][0] and "root:x" not in repr(errors)
        with pytest.raises(DataError) as e:
            list(dataset(url, str(root)))
        assert e.value.key == "1" and bad in str(e.value)
        assert b"root:" not in repr(e.value.value).encode() and "root:x" not in str(e.value)


def test_header_error_value_is_the_image_name_not_its_bytes() -> None:
    from streampack.media.header import read_header

    with pytest.raises(DataError) as e:
        read_header(SECRET, url="s.tar", key="k", name="0.png", max_pixels=10**6)
    assert e.value.value == "0.png" and "root:" not in str(e.value)
    assert f"({len(SECRET)} bytes) is not a JPEG, PNG or WebP file" in str(e.value)  # what is wrong, not a BytesIO


def test_a_bytes_value_is_never_carried_by_a_data_error() -> None:
    err = DataError("bad_image", "image 'a.png' is not an image", url="s.jsonl", key="k", value=SECRET)
    assert err.value == f"<{len(SECRET)} bytes>" and "root:" not in str(err)


def test_bad_npy_and_pickle_members_are_named_never_shown() -> None:
    import pickle

    from streampack.io.npy import decode_npy
    from streampack.io.tar_decode import _unpickle

    with pytest.raises(DataError) as e:
        decode_npy(b"\x93NUMPY\x01\x00" + SECRET, member="input_ids.npy", url="s.tar", key="k")
    assert e.value.value == "input_ids.npy" and "root:" not in str(e.value)
    with pytest.raises(DataError) as e:
        _unpickle(pickle.PROTO + b"\x05" + SECRET, "a.pyd", url="s.tar", key="k")
    assert e.value.value == "a.pyd" and "root:" not in str(e.value)


@pytest.mark.parametrize("line", [SECRET.split(b"\n")[0], json.dumps(SECRET.decode()).encode(),
                                  json.dumps({"text": {"pw": SECRET.decode()}}).encode(),
                                  json.dumps({"input_ids": SECRET.decode()}).encode(),
                                  json.dumps({"input_ids": [1, SECRET.decode()]}).encode(),
                                  b'{"text": "\xffroot:x:0:0:root:/root:/bin/bash"}',
                                  b'{"root:x:0:0": ' * 200 + b"1" + b"}" * 200])
def test_a_jsonl_line_that_is_not_a_sample_is_named_never_shown(tmp_path: Path, line: bytes) -> None:
    # a shard path that names the wrong file (or a hostile line) must not copy its bytes into
    # the exception, the logs and metrics()["errors"]
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2, 3]}\n' + line + b'\n{"input_ids": [4, 5]}\n')
    ds = PackedDataset([str(path)], capacity=16, epochs=1, shuffle=False, read=ReadOptions(on_error="skip"))
    assert sum(b.num_docs for b in ds) == 2
    errors = ds.metrics()["errors"]
    assert errors["total"] == 1 and "root:x" not in repr(errors) and "key='1'" in errors["recent"][0]
    with pytest.raises(DataError) as e:
        list(PackedDataset([str(path)], capacity=16, epochs=1, shuffle=False))
    assert e.value.key == "1" and "root:x" not in str(e.value) and "root:x" not in repr(e.value.value)


def test_a_nul_byte_in_an_image_path_is_a_counted_bad_image(tmp_path: Path) -> None:
    # finding: a plain "ValueError: embedded null byte" with no shard or key, which ended a run
    # under on_error="skip" too
    root, _ = local_root(tmp_path)
    (root / "sub" / "1.png").write_bytes(image_bytes(30, 20, seed=4))
    url = write_jsonl(tmp_path / "a.jsonl", ["0.png", "sub/1.png\u0000.png", "1.png"])
    err = assert_refused(url, str(root), bad_key="1", good=2)
    assert "NUL" in str(err)


def test_a_nul_byte_in_an_http_image_path_is_refused_before_any_request(tmp_path: Path) -> None:
    www = web_root(tmp_path)
    url = write_jsonl(tmp_path / "a.jsonl", ["0.png", "1.png\u0000.png", "1.png"])
    with serve_faulty(www) as server:
        assert_refused(url, server.url + "/images", bad_key="1", good=2)
        requested = [r.path for r in server.requests]
        assert len(requested) >= 2 and not any("%00" in p or "\x00" in p for p in requested), requested


RULE = DynamicResolution(patch_size=14, merge_size=2, min_pixels=28 * 28, max_pixels=28 * 28 * 64)


def write_numbered_tar(path: Path, names: list[str]) -> Path:
    """One sample: a placeholder per image, image ``names[j]`` 28 x 28·(j+1) pixels, so its grid
    (1, 2j+2, 2) tells which image sits on which placeholder."""
    ids = sample_ids(np.random.default_rng(0), len(names), 4)
    with tarfile.open(path, "w") as tf:
        add_member(tf, "k0.json", json.dumps({"input_ids": ids}).encode())
        for j, name in enumerate(names):
            add_member(tf, f"k0.{name}", image_bytes(28, 28 * (j + 1), "PNG", seed=j))
    return path


def test_tar_images_sit_on_their_placeholders_in_number_order(tmp_path: Path) -> None:
    # finding: 0.png ... 11.png were taken as 0, 1, 10, 11, 2, ..., 9: from the third placeholder
    # on every image sat on another's placeholder, with no error
    names = [f"{j}.png" for j in range(12)]
    url = str(write_numbered_tar(tmp_path / "a.tar", names))
    media = MediaOptions(rule=RULE, image_token_id=IMAGE_ID)
    (batch,) = list(PackedDataset([url], capacity=512, epochs=1, shuffle=False, media=media))
    assert batch.vision.image_grid_thw.tolist() == [[1, 2 * (j + 1), 2] for j in range(12)]


def test_reader_orders_numbered_tar_members_by_number() -> None:
    media = MediaOptions(rule=FIXED, image_token_id=IMAGE_ID)
    fields = {f"{j}.{('png', 'jpg')[j % 2]}": image_bytes(8 + j, 8, ("PNG", "JPEG")[j % 2], seed=j)
              for j in (10, 2, 0, 1, 11, 9)}
    got = media.reading().tar_images(fields, media_limits(), url="s.tar", key="k")
    assert [im.name for im in got] == ["0.png", "1.jpg", "2.png", "9.jpg", "10.png", "11.jpg"]
    single = media.reading().tar_images({"jpg": image_bytes(8, 8, "JPEG")}, media_limits(), url="s.tar", key="k")
    assert [im.name for im in single] == ["jpg"]  # webdataset's one-image sample (k.jpg) keeps working


@pytest.mark.parametrize("names", [["0.png", "1.png", "cover.png"], ["1.png", "01.png"], ["a.png", "b.png"]])
def test_tar_images_without_an_order_are_a_clear_error(tmp_path: Path, names: list[str]) -> None:
    url = str(write_numbered_tar(tmp_path / "a.tar", names))
    media = MediaOptions(rule=RULE, image_token_id=IMAGE_ID)
    with pytest.raises(DataError, match="bad_image.*number") as e:
        list(PackedDataset([url], capacity=512, epochs=1, shuffle=False, media=media))
    assert e.value.key == "k0"
