"""Time to hand one batch-1 decode step from rank 0 to rank 1 (two processes, gloo group): the shared-memory
mailbox against gloo's broadcast_object_list (minillm/parallel/step_channel.py), 2000 steps each, best of two
rounds, alternated. Usage: python figures/cpu/sweeps/step_channel.py PORT OUT.json"""
import os, sys, time, json, torch.distributed as dist, torch.multiprocessing as mp
from minillm.parallel.step_channel import open_channel
from minillm.parallel.workers import run_forward
STEP = ([5], [300], [4800], [list(range(24))], [1], [301], [0])  # a batch-1 decode step's lists
def run(rank, address, n):
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
    out = {}
    for choice in ("shm", "gloo", "shm", "gloo"):
        os.environ["MINILLM_STEP_CHANNEL"] = choice
        ch = open_channel(dist.group.WORLD, rank, 2)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0: ch.send((run_forward, (STEP,)))
            else: ch.recv()
        if rank == 0: ch.send(None)   # waits for the worker's acknowledgement of the last step (shm)
        else: ch.recv()
        dist.barrier()
        out.setdefault(choice, []).append((time.perf_counter() - t0) / n * 1e6)
        ch.close()
    if rank == 0:
        import platform
        from minillm.bench.harness import result_header
        runs = {k: {"us_per_step": min(v), "rounds_us": v} for k, v in out.items()}
        doc = result_header("step_channel", "batch-1 decode step message, 2000 steps", "-",
                            "python figures/cpu/sweeps/step_channel.py PORT figures/cpu/step_channel.json")
        doc |= dict(device=f"CPU ({platform.machine()}, {os.cpu_count()} cores)", runs=runs)
        json.dump(doc, open(sys.argv[2], "w"), indent=1)
        print(json.dumps({k: round(r["us_per_step"], 1) for k, r in runs.items()}))
    dist.destroy_process_group()
if __name__ == "__main__":
    address = f"tcp://127.0.0.1:{sys.argv[1]}"
    w = mp.get_context("spawn").Process(target=run, args=(1, address, 2000)); w.start(); run(0, address, 2000); w.join()
