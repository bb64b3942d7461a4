"""How rank 0 hands each step to the other ranks: a mailbox in shared memory.

Why it exists: before every forward pass rank 0 sends the step's metadata (token ids, positions,
slots, block tables: small pickled lists) to every other rank, and the layers' collectives cannot
start until each rank has it. Sent with ``dist.broadcast_object_list`` over gloo, that is two TCP
broadcasts (sizes, then bytes) per step. On two H200s a batch-1 Llama-2-7B step spent 1.3 ms of
host time in series with its 3.4 ms of GPU work (``figures/h200/tp_decode_profile.json``). The
ranks of one tensor- or pipeline-parallel LLM share a machine, so a memory page they all map does
the same job in microseconds (vLLM's ``MessageQueue`` solves the same problem with a ring of
shared-memory buffers).

The mailbox is one buffer: a header of int64 words, then the message.

    word 0: sequence number of the message in the buffer (written last, after the bytes)
    word 1: its length in bytes, or -1: too big for the buffer, sent over gloo instead
    word 2 + i: the last sequence number rank i + 1 has read (its acknowledgement)

Rank 0 writes a message only once every rank has acknowledged the previous one, so a reader never
sees a buffer being overwritten. Readers poll word 0: a busy loop (yielding the core to anything
else runnable) for the first 20 ms, so that the next decode step, a few milliseconds away on a GPU,
is seen within microseconds; then sleeps that grow to 1 ms, so that an idle LLM between two
``generate`` calls costs almost no CPU. Rank 0 stores the bytes, then the length, then
the sequence number; a reader that sees the number must see the bytes, which x86's store order
(TSO) guarantees and a weakly ordered CPU (ARM) does not without fences Python cannot issue. So
the mailbox is used on x86 machines only, and only when every rank runs on the same host;
elsewhere ``open_channel`` returns ``GlooChannel``, the broadcast over gloo it replaces.

The buffer is a file under /dev/shm (RAM on Linux), unlinked as soon as every rank has mapped it:
no name is left behind, whatever way the processes end. A waiting rank checks every second that
the others are alive, so a dead peer is an error, not a wait forever.
"""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import socket
import tempfile
import time

import torch.distributed as dist

CAPACITY = 8 << 20  # bytes of message: a prefill step of 8192 tokens pickles to ~0.2 MB
SPIN_S = 0.02  # busy-wait this long before sleeping: longer than a decode step
FIRST_SLEEP_S, MAX_SLEEP_S = 50e-6, 1e-3
LIVENESS_S = 1.0  # how often a waiting rank checks that its peers are alive
TOO_BIG = -1
_yield_core = getattr(os, "sched_yield", lambda: None)  # not on Windows
ORDERED_STORES = ("x86_64", "amd64", "i386", "i686", "x86")  # CPUs with total store order


def open_channel(group, rank: int, size: int, peers_alive=None, capacity: int = CAPACITY,
                 shared_memory: bool = True) -> "StepChannel | GlooChannel":
    """The shared-memory mailbox where it is safe (x86, one host) and ``shared_memory``, else gloo broadcasts.
    Collective: every rank of ``group`` calls it at the same point."""
    hosts = [None] * size
    dist.all_gather_object(hosts, (socket.gethostname(), platform.machine().lower()), group=group)
    if shared_memory and len({host for host, _ in hosts}) == 1 and all(m in ORDERED_STORES for _, m in hosts):
        return StepChannel(group, rank, size, peers_alive, capacity)
    return GlooChannel(group)


class GlooChannel:
    """Rank 0's messages as ``broadcast_object_list`` over gloo: any machines, any CPU."""

    def __init__(self, group):
        self.group = group

    def send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        pass


class StepChannel:
    """Rank 0 ``send``s Python objects; ranks > 0 ``recv`` them, in order. Built collectively by
    every rank of ``group`` (gloo), on one machine."""

    def __init__(self, group, rank: int, size: int, peers_alive=None, capacity: int = CAPACITY):
        self.group, self.rank, self.size = group, rank, size
        # Rank 0: a callable that raises if a worker is gone; ranks > 0 check rank 0's pid.
        self.peers_alive = peers_alive
        self.header_words = 2 + (size - 1)
        self.offset = 8 * self.header_words
        path = None
        if rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            fd, path = tempfile.mkstemp(prefix="minillm-steps-", dir=folder)
            os.ftruncate(fd, self.offset + capacity)
            os.close(fd)
        named = [(path, os.getpid(), capacity)]
        dist.broadcast_object_list(named, src=0, group=group)
        path, self.rank0_pid, self.capacity = named[0]
        self.rank0_is_parent = os.getppid() == self.rank0_pid
        with open(path, "r+b") as file:
            self.buffer = mmap.mmap(file.fileno(), self.offset + self.capacity)
        self.words = memoryview(self.buffer).cast("B")[:self.offset].cast("q")
        dist.barrier(group=group)  # every rank has mapped it: the name is no longer needed
        if rank == 0:
            os.unlink(path)
        self.sequence = 0

    def send(self, message) -> None:
        """Rank 0: hand ``message`` to every other rank."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._wait(lambda: all(self.words[2 + i] == self.sequence for i in range(self.size - 1)))
        if len(data) <= self.capacity:
            self.buffer[self.offset:self.offset + len(data)] = data
            self.words[1] = len(data)
        else:
            self.words[1] = TOO_BIG
        self.sequence += 1
        self.words[0] = self.sequence
        if len(data) > self.capacity:
            dist.broadcast_object_list([message], src=0, group=self.group)

    def recv(self):
        """Ranks > 0: the next message rank 0 sent."""
        expected = self.sequence + 1
        self._wait(lambda: self.words[0] == expected)
        length = self.words[1]
        if length == TOO_BIG:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            message = box[0]
        else:
            message = pickle.loads(self.buffer[self.offset:self.offset + length])
        self.sequence = expected
        self.words[2 + self.rank - 1] = expected  # read: rank 0 may overwrite the buffer now
        return message

    def close(self) -> None:
        self.words.release()
        self.buffer.close()

    def _wait(self, ready) -> None:
        start = last_check = time.perf_counter()
        sleep = FIRST_SLEEP_S
        while not ready():
            now = time.perf_counter()
            if now - start < SPIN_S:
                _yield_core()
                continue
            if now - last_check > LIVENESS_S:
                last_check = now
                self._check_peers()
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_SLEEP_S)

    def _check_peers(self) -> None:
        if self.rank == 0:
            if self.peers_alive is not None:
                self.peers_alive()
            return
        # A worker that LLM(...) started is rank 0's child: re-parented once rank 0 is gone (even while
        # rank 0 is an unreaped zombie, which the signal test below would still find).
        orphaned = self.rank0_is_parent and os.getppid() != self.rank0_pid
        try:
            os.kill(self.rank0_pid, 0)
        except ProcessLookupError:
            orphaned = True
        if orphaned:
            raise RuntimeError(f"rank {self.rank}: rank 0 (pid {self.rank0_pid}) has exited; stopping")
