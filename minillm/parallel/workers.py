"""Starting the processes of a tensor- or pipeline-parallel LLM and keeping them in step.

``LLM(model, tensor_parallel_size=N)`` (or ``pipeline_parallel_size=N``) is rank 0. It checks that
the model splits into N (before anything starts), then starts ranks 1..N-1 itself
(torch.multiprocessing, "spawn"; gloo on a CPU, NCCL on GPUs, one GPU per rank). Every rank builds
an ``Engine`` over its part of the model (``model_part``: a tensor-parallel ``Shard`` or a pipeline
``Stage``) and the KV cache of that part. Only rank 0 schedules: before each forward pass its runner
broadcasts the step's metadata — token ids, positions, slot mapping, block tables, lengths, the rows
to sample, all plain lists — and every rank runs that same forward, so the collectives inside the
layers (``tp.py``) or the sends between stages (``pp.py``) pair up. Rank 0 gets full logits and
samples. A multi-step batch (``multi_step.py``) travels as one plan for all its passes; rank 0 then
broadcasts each pass's sampled tokens on the device, which every rank feeds to its next pass. Any other call that every rank must make together (gathering pipeline timings, timing a
collective) travels the same way: ``run_everywhere`` broadcasts a module-level function and its
arguments, and each rank calls it on its runner. ``close()`` (or the end of the program) sends
ranks > 0 an empty message, and they exit.

Under ``torchrun --nproc-per-node N`` the processes exist already: rank 0 drives, and ``LLM(...)``
on every other rank serves rank 0's steps, then ends the process when rank 0 closes its LLM.
"""

from __future__ import annotations

import atexit
import os
import socket
import warnings
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.config import EngineConfig, resolve_device
from minillm.model.config import ModelConfig
from minillm.multi_step import follow_decode_steps
from minillm.parallel.pp import Stage
from minillm.parallel.step_channel import open_channel
from minillm.parallel.tp import Shard, check_layout

# Ranks > 0 wait for rank 0's next step as long as the user takes between two generate() calls.
IDLE_TIMEOUT = timedelta(days=365)
# Starting up and the collectives inside a forward pass: long enough to load a big checkpoint.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)

_driver: weakref.ref | None = None  # rank 0 of the parallel LLM this process started, if any


def parallel_size(config: EngineConfig) -> tuple[str, int]:
    """The EngineConfig field that asks for processes, and its value (the config allows one at a time)."""
    if config.pipeline_parallel_size > 1:
        return "pipeline_parallel_size", config.pipeline_parallel_size
    return "tensor_parallel_size", config.tensor_parallel_size


def model_part(config: EngineConfig, rank: int) -> tuple[Shard | Stage, ModelConfig]:
    """The part of the model rank ``rank`` holds (checked: the model, quantized as asked or as its
    checkpoint is, must split that way) and the whole model's shape."""
    from minillm.model.loader import read_model_config, read_quantization
    from minillm.quant.spec import QuantSpec

    model = read_model_config(config.model, config.load_format)
    if config.pipeline_parallel_size > 1:
        return Stage.of(model, rank, config.pipeline_parallel_size), model
    spec = read_quantization(config.model, config.load_format)
    if spec is None and config.quantization is not None:
        spec = QuantSpec.parse(config.quantization)
    check_layout(model, config.tensor_parallel_size, spec)
    return Shard(rank, config.tensor_parallel_size), model


class Workers:
    """This process's place in the group and, on rank 0 of ``LLM(...)``, the workers it started."""

    def __init__(self, part: Shard | Stage, model_config: ModelConfig, device: torch.device,
                 processes=(), connections=()):
        self.part, self.model_config, self.device = part, model_config, device  # model_config: the whole model
        self.processes, self.connections = processes, connections = list(processes), list(connections)
        # Step metadata are pickled Python lists, sent through shared memory (step_channel.py); gloo
        # carries the rest of the bookkeeping even when the layers use NCCL.
        self.meta_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.channel = open_channel(self.meta_group, part.rank, dist.get_world_size(),
                                    peers_alive=lambda: _check_alive(processes))  # not self: the finalizer's args must not reach it
        self.before_shutdown: list = []  # see on_shutdown
        self._finalizer = weakref.finalize(self, _shutdown, part.rank, self.channel, self.processes,
                                           self.before_shutdown)
        atexit.register(self._finalizer)  # registered after multiprocessing's own exit hook, so it runs first

    def on_shutdown(self, release) -> None:
        """Call ``release()`` on this rank before the group is destroyed, the last registered first
        (as ``atexit`` does: what was built on top goes first). The Engine's CUDA graphs: NCCL's
        teardown waits until every graph that captured one of its collectives is gone."""
        self.before_shutdown.append(release)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def rank(self) -> int:
        return self.part.rank

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device, engine_class) -> "Workers":
        """Join the group this process belongs to, or (rank 0 of ``LLM(...)``) create it, its workers each
        building an ``engine_class(config)`` (the Engine: passed in, since the engine sits above this module)."""
        global _driver
        name, size = parallel_size(config)
        if dist.is_initialized():  # a worker started below, or a script that made the group itself
            if live_driver() is not None:
                raise RuntimeError("this process already drives a parallel LLM; close() it "
                                   "(or use it as a context manager) before starting another")
            if dist.get_world_size() != size:
                raise ValueError(f"{name}={size}, but the process group has "
                                 f"{dist.get_world_size()} processes; make them equal")
            rank = dist.get_rank()
            return cls(*model_part(config, rank), _rank_device(device, rank, size))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if world != size:
                raise ValueError(f"{name}={size}, but torchrun started {world} processes; "
                                 f"make them equal (--nproc-per-node {size})")
            part, model = model_part(config, rank)
            device = _rank_device(device, rank, size)
            dist.init_process_group(_backend(device), timeout=COLLECTIVE_TIMEOUT)
            return cls(part, model, device)
        part, model = model_part(config, 0)  # fail before starting anything
        device = _rank_device(device, 0, size)
        address = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")  # a fresh interpreter: CUDA cannot be forked
        processes, connections = [], []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker_main, name=f"minillm-rank{rank}", daemon=True,
                                      args=(engine_class, config, rank, address, theirs, torch.get_num_threads()))
            process.start()
            processes.append(process)
            connections.append(ours)
        # A worker that dies before it joins would leave rank 0 waiting in the rendezvous for the
        # whole COLLECTIVE_TIMEOUT: each says "joining" first, and rank 0 watches for exits meanwhile.
        try:
            for rank, (process, connection) in enumerate(zip(processes, connections), start=1):
                _expect(process, connection, rank, "joining")
        except RuntimeError:
            for process in processes:
                process.terminate()
            raise
        dist.init_process_group(_backend(device), init_method=address, rank=0, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        driver = cls(part, model, device, processes, connections)
        _driver = weakref.ref(driver)
        return driver

    def connect(self, runner) -> None:
        """Rank 0, once its Engine is built: wait until every worker has built its own, then
        broadcast each step before running it."""
        if self.rank != 0:
            return
        for rank, (process, connection) in enumerate(zip(self.processes, self.connections), start=1):
            _expect(process, connection, rank, "ready")
        runner.on_forward = lambda step: self._broadcast(run_forward, step)
        runner.on_decode_steps = lambda plan: self._broadcast(follow_decode_steps, plan)

    def run_everywhere(self, runner, function, *args):
        """Rank 0: every rank calls ``function(runner, *args)`` (a module-level function: it travels
        pickled by name); returns rank 0's result."""
        self._broadcast(function, *args)
        return function(runner, *args)

    def _broadcast(self, function, *args) -> None:
        if self.closed:
            raise RuntimeError("this parallel LLM is closed (its workers have exited); create a new one")
        self.channel.send((function, args))

    def serve(self, runner) -> None:
        """Ranks > 0: make every call rank 0 broadcasts, until the empty message that ``close`` sends."""
        while True:
            message = self.channel.recv()
            if message is None:
                break
            function, args = message
            function(runner, *args)
        self.close()

    def close(self) -> None:
        self._finalizer()  # runs _shutdown once, however often it is called

    def abandon(self) -> None:
        """Rank 0, when its own Engine failed to build: stop the workers without telling them. They
        may be inside a collective of their own build (a quantized layer's all-reduced range, a CUDA
        graph capture's all-reduce) that rank 0 will never join, so they would never hear ``close``'s
        message and rank 0 would wait on them forever."""
        detached = self._finalizer.detach()
        if detached is not None:
            _, _, args, _ = detached
            _shutdown(*args, tell_workers=False)


def run_forward(runner, step: tuple) -> None:
    runner.forward(*step)


def live_driver() -> Workers | None:
    """The open parallel group this process started (to close it when an Engine fails to build)."""
    driver = None if _driver is None else _driver()
    return None if driver is None or driver.closed else driver


def build_engine(engine_class, config: EngineConfig):
    """``engine_class(config)`` for a parallel config: on a failure, the workers it started are stopped."""
    running = live_driver()
    try:
        return engine_class(config)
    except BaseException:
        driver = live_driver()  # workers started for this Engine, which then failed to build: stop them
        if driver is not None and driver is not running:
            driver.abandon()
        raise


def _shutdown(rank: int, channel, processes: list, before_shutdown: list, tell_workers: bool = True) -> None:
    if not dist.is_initialized():
        return
    for release in reversed(before_shutdown):
        try:
            release()
        except Exception as e:  # e.g. a CUDA error after a device fault: the group must still come down
            warnings.warn(f"rank {rank}: {release} failed while shutting down: {e}", RuntimeWarning)
    told = False
    if rank == 0 and tell_workers and all(p.is_alive() for p in processes):  # a dead peer would fail it
        try:
            channel.send(None)
            told = True
        except RuntimeError:
            pass  # a rank that died meanwhile
    if rank == 0 and not told:
        # Some rank is gone or did not hear the end: stop them all before destroying, since NCCL's
        # teardown may wait on the other ranks of the node.
        _stop(processes, timeout=0)
    # Every told rank destroys the group at the same time, rank 0 included (it joins its workers
    # only afterwards), for the same reason.
    dist.destroy_process_group()
    channel.close()
    _stop(processes, timeout=30)


def _check_alive(processes: list) -> None:
    """Rank 0, waiting on its workers: an error naming the first that has exited."""
    for rank, process in enumerate(processes, start=1):
        if not process.is_alive():
            raise RuntimeError(f"rank {rank} exited (code {process.exitcode}); this parallel LLM cannot go on")


def _stop(processes: list, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for each process to exit, then terminate it."""
    for process in processes:
        process.join(timeout=timeout)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)


def _worker_main(engine_class, config, rank: int, address: str, connection, num_threads: int) -> None:
    """Rank > 0 of ``LLM(...)``: build this rank's Engine, say so, then follow rank 0's steps."""
    torch.set_num_threads(num_threads)  # as many as the parent uses: ranks share the machine's cores
    size = parallel_size(config)[1]
    device = _rank_device(resolve_device(config.device), rank, size)
    connection.send("joining")
    dist.init_process_group(_backend(device), init_method=address, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        engine = engine_class(config)
    except Exception as e:
        connection.send(f"{type(e).__name__}: {e}")
        return
    connection.send("ready")
    engine.workers.serve(engine.runner)


def _expect(process, connection, rank: int, expected: str) -> None:
    """Wait for worker ``rank`` to send ``expected``; a clear error if it exits or reports a failure instead."""
    while not connection.poll(1.0):
        if not process.is_alive():
            raise RuntimeError(
                f"rank {rank} exited (code {process.exitcode}) before it said {expected!r}. Its error is printed "
                "above; if it says the main module was imported while bootstrapping, put the script's top level "
                "under `if __name__ == '__main__':` (the workers are spawned, which re-imports the script)")
    message = connection.recv()
    if message != expected:
        raise RuntimeError(f"rank {rank} failed to start: {message}")


def _rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """GPU ``rank`` (its local index under torchrun) on CUDA; the CPU is shared by all ranks."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if size > count:
        raise ValueError(f"{size} ranks need {size} GPUs (one per rank), but torch sees {count}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    return device


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
