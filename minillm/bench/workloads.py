"""The benchmark workloads of BENCHMARKS.md, seeded, by name.

Every workload is a list of requests made of random token ids (so any model, even with dummy weights
and no tokenizer, can run it) with a fixed output length and ``ignore_eos``: the work done is then
the same for minillm and for every peer. Sizes come in two scales: ``gpu`` (the published figures)
and ``cpu`` (notebooks and CI).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOKEN_LOW, TOKEN_HIGH = 100, 30000  # ids drawn from [100, 30000), away from special tokens


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0  # seconds after the run starts


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    high = min(TOKEN_HIGH, vocab_size)
    low = min(TOKEN_LOW, high // 2)
    return [rng.randrange(low, high) for _ in range(n)]


def _mixed(rng, n, vocab, scale):
    inp, out = ((128, 1024), (32, 256)) if scale == "gpu" else ((16, 128), (16, 128))
    return [WorkloadRequest(random_tokens(rng, rng.randint(*inp), vocab), rng.randint(*out)) for _ in range(n)]


def _nanovllm(rng, n, vocab, scale):
    # nano-vllm's bench.py: input U[100, 1024], output U[100, 1024].
    return [WorkloadRequest(random_tokens(rng, rng.randint(100, 1024), vocab), rng.randint(100, 1024))
            for _ in range(n)]


def _tuning_path(rng, n, vocab, scale):
    # 8 shared system prompts; at GPU scale 192 shared + 320 unique tokens (192 = 12 blocks of 16).
    shared_len, unique_len, out = (192, 320, (32, 512)) if scale == "gpu" else (48, 80, (8, 64))
    systems = [random_tokens(rng, shared_len, vocab) for _ in range(8)]
    return [WorkloadRequest(rng.choice(systems) + random_tokens(rng, unique_len, vocab), rng.randint(*out))
            for _ in range(n)]


def _shared_prefix(rng, n, vocab, scale):
    system_len, question_len = (2000, 100) if scale == "gpu" else (256, 32)
    system = random_tokens(rng, system_len, vocab)
    return [WorkloadRequest(system + random_tokens(rng, question_len, vocab), 64) for _ in range(n)]


def _multi_turn_open(rng, n, vocab, scale):
    # Open loop: n chats x 4 turns, every turn known before the run and arriving at t=0. Each turn resends
    # the history plus a new 64-token user message; the assistant's earlier answers are stand-in random
    # tokens of the output length (64), since the real ones are not known before the run. The list goes
    # turn by turn (every chat's first turn, then every second turn...), so list order is admission
    # order; listed chat by chat, turn k would be admitted in the same step as turn k-1, before that
    # prompt was computed and cached. A chat as it really arrives, each turn sent after the last answer
    # with that answer in it, is the closed-loop `multi-turn` of ``minillm.bench.chat_loop``.
    chats = []
    for _ in range(n):
        history: list[int] = []
        turns = []
        for _turn in range(4):
            history = history + random_tokens(rng, 64, vocab)
            turns.append(WorkloadRequest(list(history), 64))
            history = history + random_tokens(rng, 64, vocab)
        chats.append(turns)
    return [chat[turn] for turn in range(4) for chat in chats]


def _latency(rng, n, vocab, scale):
    out = 256 if scale == "gpu" else 64
    return [WorkloadRequest(random_tokens(rng, 128, vocab), out) for _ in range(n)]


# name -> (builder, default request count at gpu scale, at cpu scale)
WORKLOADS = {
    "mixed": (_mixed, 128, 32),
    "nanovllm": (_nanovllm, 256, 256),
    "tuning-path": (_tuning_path, 256, 32),
    "shared-prefix": (_shared_prefix, 64, 16),
    "multi-turn-open": (_multi_turn_open, 64, 8),
    "latency": (_latency, 5, 3),
}


def make_workload(name: str, scale: str = "gpu", num_requests: int | None = None, seed: int = 0,
                  vocab_size: int = 32000) -> list[WorkloadRequest]:
    """The named workload; ``num_requests`` takes the first N of it (multi-turn-open: the first N chats,
    still listed turn by turn)."""
    if name == "multi-turn":
        raise ValueError("workload 'multi-turn' is closed-loop: each turn holds the answer to the one before, so "
                         "it is no list of requests made in advance; run it with minillm.bench.chat_loop (or "
                         "`minillm bench throughput --workload multi-turn`), or take the open-loop 'multi-turn-open'")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    if scale not in ("gpu", "cpu"):
        raise ValueError(f"scale must be 'gpu' or 'cpu', got {scale!r}")
    build, gpu_n, cpu_n = WORKLOADS[name]
    n = num_requests if num_requests is not None else (gpu_n if scale == "gpu" else cpu_n)
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    return build(random.Random(f"{name}-{seed}"), n, vocab_size, scale)
