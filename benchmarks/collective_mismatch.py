"""A deliberately mismatched capture across ranks: every rank must raise, within 30 s.

Each rank captures a step with an all-reduce; rank 1 captures one more. Before the first
replay the ranks compare what their captures hold, so every rank raises
``CollectiveMismatchError`` (not a hang at the replay). Then a replay that waits on a peer that
never replays raises ``ReplayTimeoutError`` on the waiting rank. Prints each rank's outcome and
how long it took; exit code 1 when a rank did not raise or took longer than 30 s.

    torchrun --nproc-per-node 2 benchmarks/collective_mismatch.py
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import cudagraphs as cg

LIMIT_S = 30.0


def main() -> int:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)

    def step(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        if rank == 1:
            dist.all_reduce(x)  # the mismatch: one more collective on this rank only
        return x * 2

    ok = True
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cg.CudaGraphsWarning)  # CPU: the pass-through
            cg.graph(step, torch.ones(8, device=device))
        outcome = "no error" if cuda else "no error (the CPU pass-through captures nothing)"
        ok = not cuda
    except cg.CollectiveMismatchError as error:
        outcome = f"CollectiveMismatchError: {str(error).splitlines()[0]}"
    seconds = time.perf_counter() - start
    ok = ok and seconds < LIMIT_S
    print(f"rank {rank}: {outcome} after {seconds:.1f} s", flush=True)
    if cuda:
        # A replay whose peer never replays: the waiting rank raises within its timeout.
        def lonely(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

        try:
            g = cg.graph(lonely, torch.ones(8, device=device), replay_timeout_s=5.0)
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                g(torch.ones(8, device=device))  # rank 1 never replays
                outcome = "returned"
                ok = False
            else:
                outcome = "did not replay"
        except cg.ReplayTimeoutError as error:
            outcome = f"ReplayTimeoutError: {str(error).splitlines()[0]}"
        print(
            f"rank {rank}: lonely replay: {outcome} after {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        os._exit(0 if ok else 1)  # the NCCL kernel may still wait: do not tear down the group
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
