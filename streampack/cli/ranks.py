"""``streampack index`` and ``streampack pack`` as the ranks of a job: who this process is, its share, the wait.

Every rank of a ``torchrun`` or SLURM job (or W processes given ``--rank R --world-size W``) runs the same command.
Rank ``r`` of ``W`` takes the shards ``r, r + W, r + 2W, ...`` of the expanded URL list, writes one part file of
what it made under the output directory, and rank 0 waits for the W parts and writes the one manifest. The output
directory is the rendezvous (a shared filesystem or an object store): no process group is needed, and none is used
when one exists.

Strided, not contiguous: data sets are listed by source or date, and shard sizes trend along the list (a source's
shards larger than another's, each source's last shard short); a stride spreads every such run over all ranks, so
each rank's bytes stay within about one shard of the others' whenever sizes vary slowly, where contiguous shares
would hand one rank a whole source. Sizes are not in a listing of URLs, so no split by size is attempted.

Rank 0 merges, not the last rank to finish: "last" needs an atomic counter or a listing that two ranks may both (or
neither) see complete, while rank 0 is known before anything runs, and it is the rank whose exit code and log a
launcher reports. It waits at most ``--wait-timeout`` seconds *between* two parts arriving (a slow but progressing
job is never cut), polling the missing parts only.

**Cost** of the wait on rank 0: one read (a ``stat`` or HEAD, a GET once there) per missing part per poll, polls
0.05 s apart doubling to 5 s; the merge reads each of the W parts once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from streampack.cli._data import CliError

T = TypeVar("T")

PARTS_DIR = "parts"
"""Where the ranks' part files go, under the output directory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRank:
    """This process's place in the job."""

    rank: int
    world_size: int
    source: str
    """Where the two came from (``--rank/--world-size``, torchrun's or SLURM's variables, or one process)."""
    launch: str = ""
    """This launch's id, the same on every rank and new at every launch (``--launch-id``, else torchrun's
    ``TORCHELASTIC_RUN_ID``, else SLURM's ``SLURM_JOB_ID.SLURM_STEP_ID``; empty when none is known): rank 0 merges
    only parts written under it, so a part an earlier launch left is never taken for one this launch wrote."""

    def share(self, n: int) -> range:
        """Positions of the shards this rank handles among ``n``: every ``world_size``-th from ``rank``."""
        return range(self.rank, n, self.world_size)

    def part_name(self, world_size: int | None = None, rank: int | None = None) -> str:
        """``rank-RRRRR-of-WWWWW``: a part's name (this rank's by default); parts of another world size never
        collide with this job's, so a relaunch with another size merges only its own."""
        return f"rank-{self.rank if rank is None else rank:05d}-of-{world_size or self.world_size:05d}"

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} ({self.source})"


_ENVIRONMENTS = (("torchrun (RANK / WORLD_SIZE)", "RANK", "WORLD_SIZE"),
                 ("SLURM (SLURM_PROCID / SLURM_NTASKS)", "SLURM_PROCID", "SLURM_NTASKS"))


def launch_id(given: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """``given``, else torchrun's run id (``--standalone`` draws a new one per launch; ``none`` is its unset
    default), else SLURM's job and step ids, else ``""`` (parts are then told apart by each rank removing its own
    old part when it starts)."""
    if given:
        return given
    run = environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"torchrun:{run}"
    if "SLURM_JOB_ID" in environ:
        return f"slurm:{environ['SLURM_JOB_ID']}.{environ.get('SLURM_STEP_ID', '')}"
    return ""


def job_rank(rank: int | None, world_size: int | None, environ: Mapping[str, str] = os.environ,
             launch: str | None = None) -> JobRank:
    """This process's rank and the job's size: ``--rank/--world-size`` first, then torchrun's ``RANK`` /
    ``WORLD_SIZE``, then SLURM's ``SLURM_PROCID`` / ``SLURM_NTASKS``, else one process; ``CliError`` naming the
    values when half of a pair is given, a value is not an integer, or the rank is outside ``[0, world_size)``."""
    if (rank is None) != (world_size is None):
        raise CliError(f"--rank={rank} --world-size={world_size}: give both, or neither (then torchrun's "
                       f"RANK / WORLD_SIZE or SLURM's SLURM_PROCID / SLURM_NTASKS are read)")
    found: tuple[str, Any, Any] | None = ("--rank / --world-size", rank, world_size) if rank is not None else None
    for source, rank_var, size_var in _ENVIRONMENTS:
        if found is not None:
            break
        if rank_var in environ or size_var in environ:
            if rank_var not in environ or size_var not in environ:
                raise CliError(f"{source}: only {rank_var if rank_var in environ else size_var} is set")
            found = (source, environ[rank_var], environ[size_var])
    if found is None:
        return JobRank(rank=0, world_size=1, source="one process", launch=launch_id(launch, environ))
    source, got_rank, got_size = found
    try:
        r, w = int(got_rank), int(got_size)
    except ValueError:
        raise CliError(f"{source}: rank {got_rank!r} and world size {got_size!r} must be integers") from None
    if not (w >= 1 and 0 <= r < w):
        raise CliError(f"{source}: rank={r}, world size={w}: want world size >= 1 and 0 <= rank < world size")
    return JobRank(rank=r, world_size=w, source=source, launch=launch_id(launch, environ))


def job_of(args: Any) -> JobRank:
    """:func:`job_rank` of the flags :func:`add_rank_arguments` added, ``--wait-timeout`` checked before any work."""
    if not args.wait_timeout >= 0:
        raise CliError(f"--wait-timeout={args.wait_timeout} must be >= 0")
    return job_rank(args.rank, args.world_size, launch=args.launch_id)


def add_rank_arguments(p: Any) -> None:
    p.add_argument("--rank", type=int, default=None,
                   help="this process's rank in a job of --world-size processes (default: torchrun's RANK, "
                        "else SLURM's SLURM_PROCID, else a job of one)")
    p.add_argument("--world-size", type=int, default=None, help="processes in the job (see --rank)")
    p.add_argument("--launch-id", default=None, metavar="ID",
                   help="the same on every rank, new at each launch (default: torchrun's TORCHELASTIC_RUN_ID, else "
                        "SLURM's job and step ids): rank 0 merges only parts written under it")
    p.add_argument("--wait-timeout", type=float, default=3600.0, metavar="S",
                   help="rank 0: seconds to wait for the next rank's part before giving up, naming the ranks "
                        "missing (default %(default)s)")


def gather(load: Callable[[int], T | None], world_size: int, *, timeout: float, where: str,
           sleep: Callable[[float], None] = time.sleep) -> list[T]:
    """Every rank's part, in rank order: ``load(r)`` returns it, None while it is not there, or raises
    ``CliError`` (a failed or mismatched rank). ``CliError`` naming the missing ranks when ``timeout`` seconds
    pass without a new part."""
    parts: dict[int, T] = {}
    pause, last = 0.05, time.monotonic()
    while True:
        for r in range(world_size):
            if r not in parts:
                got = load(r)
                if got is not None:
                    parts[r] = got
                    last = time.monotonic()
        if len(parts) == world_size:
            return [parts[r] for r in range(world_size)]
        if time.monotonic() - last > timeout:
            missing = [r for r in range(world_size) if r not in parts]
            shown = ", ".join(map(str, missing[:16])) + (f" ... ({len(missing)} in all)" if len(missing) > 16 else "")
            raise CliError(f"rank 0 waited {timeout:g} s for the parts of rank(s) {shown} of {world_size} under "
                           f"{where!r} and none came: relaunch the job (what each rank finished is kept)")
        sleep(pause)
        pause = min(pause * 2, 5.0)


__all__ = ["PARTS_DIR", "JobRank", "add_rank_arguments", "gather", "job_of", "job_rank", "launch_id"]
