"""A DataLoader worker process ends with the training process, whatever it is blocked on.

torch's worker loop notices a dead parent only between fetches, so a worker blocked writing its
result pipe outlived a SIGKILLed trainer for good (~400 MB each); ``prctl(PR_SET_PDEATHSIG, SIGKILL)``
ends it at once. Linux only; the signal follows the parent thread that started the worker.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``"""

_armed_pid = 0


def die_with_parent() -> None:
    """In a worker process (``multiprocessing.parent_process()`` set): be SIGKILLed when the
    parent dies. Once per process; a no-op in the main process and off Linux."""
    global _armed_pid
    parent = multiprocessing.parent_process()
    if parent is None or _armed_pid == os.getpid() or not sys.platform.startswith("linux"):
        return
    _armed_pid = os.getpid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0
    except (OSError, AttributeError):
        failed = True
    if failed:
        return  # a sandbox without prctl: torch's own watchdog is what remains
    # the parent may have died before the signal was armed (then nothing would send it)
    if os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)
