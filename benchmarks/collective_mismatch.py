"""Collective failures across ranks: every rank must raise, within 30 s, instead of hanging.

Two cases, each in its own run (an unmatched collective leaves the NCCL communicator waiting,
so nothing meaningful can follow it in the same process group):

- ``--case mismatch``: each rank captures a step with an all-reduce; rank 1 issues one more.
  Before the first replay the ranks compare what their captures hold, so every rank raises
  ``CollectiveMismatchError`` (not a hang at the replay).
- ``--case timeout``: both ranks capture the same all-reduce, but only rank 0 replays it. The
  waiting rank raises ``ReplayTimeoutError`` naming the graph once ``replay_timeout_s`` passed.

Prints each rank's outcome and how long it took; exit code 1 when a rank did not raise as
expected or took longer than 30 s.

    torchrun --nproc-per-node 2 benchmarks/collective_mismatch.py --case mismatch
    torchrun --nproc-per-node 2 benchmarks/collective_mismatch.py --case timeout
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import cudagraphs as cg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from ddp_train import start_ranks

LIMIT_S = 30.0


def mismatch(rank: int, device: torch.device, cuda: bool) -> tuple[bool, str]:
    def step(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        if rank == 1:
            dist.all_reduce(x)  # the mismatch: one more collective on this rank only
        return x * 2

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cg.CudaGraphsWarning)  # CPU: the pass-through
            cg.graph(step, torch.ones(8, device=device))
    except cg.CollectiveMismatchError as error:
        return True, f"CollectiveMismatchError: {str(error).splitlines()[0]}"
    if cuda:
        return False, "no error"
    return True, "no error (the CPU pass-through captures nothing)"


def timeout(rank: int, device: torch.device, cuda: bool) -> tuple[bool, str]:
    if not cuda:
        return True, "skipped (a replay timeout needs a graph: CUDA)"

    def lonely(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    g = cg.graph(lonely, torch.ones(8, device=device), replay_timeout_s=5.0)
    dist.barrier()
    if rank != 0:
        return True, "did not replay (on purpose)"
    try:
        g(torch.ones(8, device=device))  # rank 1 never replays: rank 0 waits
    except cg.ReplayTimeoutError as error:
        return True, f"ReplayTimeoutError: {str(error).splitlines()[0]}"
    return False, "the replay returned"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--case", choices=("mismatch", "timeout"), default="mismatch")
    args = p.parse_args()
    device = start_ranks("benchmarks/collective_mismatch.py")
    cuda, rank = device.type == "cuda", dist.get_rank()
    start = time.perf_counter()
    ok, outcome = {"mismatch": mismatch, "timeout": timeout}[args.case](rank, device, cuda)
    seconds = time.perf_counter() - start
    ok = ok and seconds < LIMIT_S
    # One write with its newline: both ranks share the terminal, and print's separate write of
    # the newline let the other rank's line land in the middle of this one.
    sys.stdout.write(f"rank {rank}: {args.case}: {outcome} after {seconds:.1f} s\n")
    sys.stdout.flush()
    if cuda:
        os._exit(0 if ok else 1)  # an NCCL kernel may still wait: do not tear down the group
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
