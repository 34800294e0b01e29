"""jsonl image paths under a remote ``image_root`` are fetched with the dataset's own read settings
(``ReadOptions``: retry cap and budget, timeouts) and counted in its I/O metrics, through a
loopback server that fails the first requests (``tests/helpers_faults.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from streampack import PackedDataset, ReadOptions
from streampack.errors import DataError
from streampack.media import FixedTokens, MediaOptions
from tests.helpers_faults import Fault, serve_faulty
from tests.helpers_media import IMAGE_ID, image_bytes, sample_ids


def corpus(tmp_path: Path, n: int = 4) -> str:
    root = tmp_path / "www" / "images"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        (root / f"{i}.jpg").write_bytes(image_bytes(40, 30, "JPEG", seed=i))
        lines.append(json.dumps({"input_ids": sample_ids(rng, 1, 8), "images": [f"{i}.jpg"]}))
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "a.jsonl")


def dataset(url: str, root: str, read: ReadOptions, **kw) -> PackedDataset:
    media = MediaOptions(rule=FixedTokens(size=28, tokens=4), image_token_id=IMAGE_ID, image_root=root)
    return PackedDataset([url], capacity=64, epochs=1, shuffle=False, media=media, read=read, **kw)


def test_image_paths_use_the_datasets_retry_cap_deadline_and_io_counters(tmp_path: Path) -> None:
    url = corpus(tmp_path)
    with serve_faulty(tmp_path / "www") as server:
        root = server.url + "/images"
        server.plan.add(Fault("status", status=503, method="*", path="/images/0.jpg"))
        with pytest.raises(DataError, match="bad_image.*HTTP 503") as e:  # no retry allowed: the first 503 ends it
            list(dataset(url, root, ReadOptions(retries=0)))
        assert e.value.key == "0" and e.value.value == "0.jpg"

        server.plan.add(Fault("status", status=503, method="*", path="/images/2.jpg"))
        ds = dataset(url, root, ReadOptions(retries=0, on_error="skip"))
        assert sum(b.vision.num_images for b in ds) == 3
        assert ds.metrics()["errors"]["counts"] == {"bad_image": 1}
        io = ds.metrics()["io"]  # the image requests are the dataset's: counted with its shards'
        assert io["faults"] == {"HTTP 503": 1} and io["gave_up"] == 1 and io["bytes"] > 0

        server.plan.add(Fault("delay", delay=3.0, method="*", path="/images/1.jpg"))
        start = time.monotonic()
        with pytest.raises(DataError, match="bad_image") as e:  # its answer comes after the deadline
            list(dataset(url, root, ReadOptions(retries=0, read_timeout=0.3, request_deadline=0.3)))
        assert e.value.key == "1" and time.monotonic() - start < 2.5


@pytest.mark.slow  # the retries' jittered backoff (0.5 s base) sleeps about 1 s
def test_image_paths_retry_within_the_datasets_budget(tmp_path: Path) -> None:
    url = corpus(tmp_path)
    with serve_faulty(tmp_path / "www") as server:
        server.plan.add(Fault("status", status=503, method="*", path="/images/"), times=2)
        ds = dataset(url, server.url + "/images", ReadOptions(retries=4, retry_budget=20))
        assert sum(b.vision.num_images for b in ds) == 4
        io = ds.metrics()["io"]
        assert io["faults"] == {"HTTP 503": 2} and io["retries"] == 2 and io["gave_up"] == 0
