"""The channel that carries each step from rank 0 to the other ranks (``minillm/parallel/step_channel.py``).

Two real processes over gloo, as ``LLM(..., tensor_parallel_size=2)`` runs them (the TP and PP tests
in test_parallel*.py send every step through it too). Here: every message arrives, in order and
unchanged, whether it fits the shared buffer or goes over gloo because it does not, and over gloo alone
(``shared_memory=False``, the channel of machines where shared memory is unsafe); a worker whose rank 0 has
died stops with an error instead of waiting forever.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, random, sys, torch.distributed as dist, torch.multiprocessing as mp
from minillm.parallel.step_channel import open_channel, StepChannel

def messages():
    rng = random.Random(7)
    # Sizes around the 4 KB buffer: most fit, some are sent over gloo instead.
    return [[rng.randrange(1 << 40) for _ in range(rng.choice((0, 1, 30, 400, 900)))] for _ in range(300)] + [None]

def run(rank, address, mode):
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
    channel = open_channel(dist.group.WORLD, rank, 2, capacity=4096, shared_memory=mode != "gloo")
    kind = type(channel).__name__
    if mode == "orphan":  # rank 0 goes away without a word; the worker must notice
        if rank == 0:
            os._exit(0)
        try:
            channel.recv()
        except RuntimeError as e:
            print("WORKER RAISED", e, flush=True)
        os._exit(0)
    if rank == 0:
        for message in messages():
            channel.send(message)
    else:
        got = []
        while (message := channel.recv()) is not None:
            got.append(message)
        print("WORKER", kind, "received", len(got), "equal", got == messages()[:-1], flush=True)
    dist.barrier()
    channel.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    mode, port = sys.argv[1], sys.argv[2]
    address = f"tcp://127.0.0.1:{port}"
    worker = mp.get_context("spawn").Process(target=run, args=(1, address, mode))
    worker.start()
    run(0, address, mode)
    worker.join()
"""


def run_script(tmp_path, mode: str) -> subprocess.CompletedProcess:
    from minillm.parallel.workers import _free_port

    script = tmp_path / "channel.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), mode, str(_free_port())], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("mode, kind", [("all", "StepChannel"), ("gloo", "GlooChannel")])
def test_every_message_arrives_in_order_unchanged(tmp_path, mode, kind):
    result = run_script(tmp_path, mode)
    assert f"WORKER {kind} received 300 equal True" in result.stdout, result.stderr[-2000:]


def test_a_worker_whose_rank0_died_stops_with_an_error(tmp_path):
    result = run_script(tmp_path, "orphan")
    assert "WORKER RAISED rank 1: rank 0 (pid" in result.stdout and "has exited" in result.stdout, result.stderr[-2000:]
