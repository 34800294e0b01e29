"""Peak memory of reading one shard, measured in a fresh process.

Shared by ``bench_hostile.py`` (the numbers in docs/reliability.md's limits table) and
``tests/integration/test_memory.py`` (the bounds they promise). A fresh process, because the peak RSS of
a process that already ran other work says nothing about one read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

_CHILD = """
import json, os, resource, sys
from streampack.errors import ErrorCounter, ErrorPolicy
from streampack.nodes.reader import ShardReader
from streampack.options import ReadOptions


def rss_kib(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


url = sys.argv[1]
reader = ShardReader(url, shuffle=False, epochs=1, read=ReadOptions(allow_pipe=True),
                     error_policy=ErrorPolicy("skip", errors := ErrorCounter()))
try:  # reset the peak to the current RSS (Linux), so the delta is the reading's own peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, peak = rss_kib("VmRSS:"), lambda: rss_kib("VmHWM:")
except OSError:  # elsewhere ru_maxrss: a lower bound when importing peaked higher
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base = peak()
keys = [s.key for s in reader]
print(json.dumps({"keys": keys, "errors": dict(errors.counts), "growth_mib": (peak() - base) // 1024}),
      flush=True)
# The measurement is printed: leave without interpreter teardown, where a native thread pool still
# joinable (seen once in ~4 slow runs after a hostile parquet read: "terminate called without an
# active exception") aborts the process and would turn a finished measurement into a failure.
os._exit(0)
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class RssRead:
    keys: list[str]
    """Keys of the samples kept (``on_error="skip"``)."""
    errors: dict[str, int]
    """Skipped samples by error kind."""
    growth_mib: int
    """Peak RSS while reading, minus the RSS right before."""


def read_in_child(url: str, *, cwd: str, timeout: float = 600) -> RssRead:
    """Read ``url`` to the end in a fresh interpreter; ``cwd`` must not hold a ``streampack``
    folder (``python -c`` puts it first on sys.path, and PYTHONPATH must decide which tree runs)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, url], capture_output=True, text=True, timeout=timeout,
                         cwd=cwd)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return RssRead(**json.loads(out.stdout.strip().splitlines()[-1]))
