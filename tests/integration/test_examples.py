"""Every example in examples/ runs to success (each checks its own claim and exits 1 if not)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Each example is a subprocess (a fresh interpreter, 3-7 s): integration, run by .ci/run's second step.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(args: list[str], timeout: int = 420, env: dict | None = None) -> str:
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pretrain_resumes_the_exact_stream():
    out = run([sys.executable, str(EXAMPLES / "pretrain.py"), "--steps", "10", "--preempt-at", "4"])
    assert "identical batch stream after resume: True; identical losses: True" in out


def test_vlm_pretrain_resumes_the_exact_stream():
    pytest.importorskip("streampack.layout.vision")  # mmb's mRoPE positions
    out = run([sys.executable, str(EXAMPLES / "vlm_pretrain.py"), "--steps", "6", "--preempt-at", "3"])
    assert "identical batch stream after resume: True; identical losses: True" in out


def test_tokenize_chain():
    out = run([sys.executable, str(EXAMPLES / "tokenize_chain.py"), "--batches", "5"])
    assert "5 batches" in out and "'tokenize'" in out


def test_hf_finetune():
    out = run([sys.executable, str(EXAMPLES / "hf_finetune.py"), "--steps", "3"])
    assert "max |diff|" in out and "step  2" in out


def test_rl_microbatches():
    run([sys.executable, str(EXAMPLES / "rl_microbatches.py")])


@pytest.mark.distributed
def test_multi_rank_with_torchrun(tmp_path):
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(EXAMPLES / "multi_rank.py")], env={"STREAMPACK_EXAMPLE_DATA": str(tmp_path)})
    assert "disjoint=True covered=240/240" in out


def test_hand_built_graph():
    out = run([sys.executable, str(EXAMPLES / "hand_built_graph.py")])
    assert "by_hand: equals PackedDataset and resumes exactly from Loader.state_dict(): True" in out
    assert "with_builder: equals PackedDataset and resumes exactly from Loader.state_dict(): True" in out


@pytest.mark.distributed
def test_elastic_restart_with_torchrun(tmp_path):
    """Finite training on 2 ranks x 2 workers, a checkpoint of every reader's state, and a
    restart on 3 ranks x 1 worker that finishes the epoch with every document once."""
    env = {"STREAMPACK_EXAMPLE_DATA": str(tmp_path)}
    ckpt = str(tmp_path / "ckpt.pt")

    def torchrun(n: int, *extra: str) -> str:
        return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                    str(EXAMPLES / "elastic_restart.py"), "--ckpt", ckpt, *extra], env=env)

    assert "checkpoint after 6 steps per rank (4 reader states)" in torchrun(2, "--stop-after", "6")
    out = torchrun(3)
    assert "every document exactly once: True; steps per rank equal: True" in out, out
