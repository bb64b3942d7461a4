"""Tensor parallelism on the CPU: gloo, two processes.

The promise is the usual one: greedy outputs with ``tensor_parallel_size=2`` are token for token
those of one process. Checked on tiny random Hugging Face models (read slice-wise from safetensors)
covering split KV heads, a single KV head replicated over both ranks, tied embeddings, qkv biases
and a vocabulary that does not split evenly, and on a dummy preset; plus the shard arithmetic
itself and the errors for layouts that cannot work.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.model.config import PRESETS, ModelConfig
from minillm.parallel.tp import Shard, check_layout, checkpoint_slice, kv_head_range, shard_config, valid_tp_sizes
from minillm.parallel.workers import _rank_device

CONTINUOUS = dict(dtype="float32", device="cpu", batching="continuous", attention_backend="torch", max_model_len=128)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7], [3], [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262, 263], [8, 9]]


def generate(model: str, **kwargs) -> list[list[int]]:
    with LLM(model, **CONTINUOUS, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def save_tiny(tmp_path, make_tiny_hf, config_cls, **overrides) -> str:
    make_tiny_hf(config_cls, seed=3, **overrides).save_pretrained(tmp_path)
    return str(tmp_path)


# -- outputs: two processes == one ---------------------------------------------------------------


def test_tp2_matches_one_process_on_a_llama(tmp_path, make_tiny_hf):
    from transformers import LlamaConfig

    model = save_tiny(tmp_path, make_tiny_hf, LlamaConfig)  # 4 heads, 2 KV heads: one of each per rank
    # A small token budget prefills the long prompt in chunks: steps where no row samples.
    expected = generate(model, max_num_batched_tokens=8)
    assert generate(model, max_num_batched_tokens=8, tensor_parallel_size=2) == expected


def test_tp2_matches_with_one_replicated_kv_head_tied_embeddings_and_bias(tmp_path, make_tiny_hf):
    from transformers import Qwen2Config

    # 1 KV head for 2 ranks (each keeps a copy), tied embeddings (vocab-parallel on both ends),
    # qkv biases (split with their rows), and 301 tokens: slices of 151 and 150, padded to gather.
    model = save_tiny(tmp_path, make_tiny_hf, Qwen2Config, num_key_value_heads=1, tie_word_embeddings=True,
                      vocab_size=301)
    expected = generate(model)
    assert generate(model, tensor_parallel_size=2) == expected


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # scales are per KV head: each rank quantizes its own
def test_tp2_dummy_weights_are_the_one_process_model(kv_cache_dtype):
    kv = dict(load_format="dummy", kv_cache_dtype=kv_cache_dtype)
    assert generate("tiny", tensor_parallel_size=2, **kv) == generate("tiny", **kv)


def test_close_stops_the_workers():
    llm = LLM("tiny", load_format="dummy", tensor_parallel_size=2, **CONTINUOUS)
    workers = llm.engine.workers.processes
    assert [p.is_alive() for p in workers] == [True]
    # Rank 0 holds its half: 2 of 4 heads, 1 of 2 KV heads in its cache, half the MLP and vocabulary.
    assert (llm.engine.model_config.num_heads, llm.engine.model_config.num_kv_heads) == (2, 1)
    assert llm.engine.runner.cache.k.shape[-2] == 1
    assert llm.engine.model.model.layers[0].mlp.down_proj.weight.shape == (64, 64)
    assert llm.engine.model.lm_head.weight.shape == (256, 64)
    with pytest.raises(RuntimeError, match="already drives a parallel LLM"):
        LLM("tiny", load_format="dummy", tensor_parallel_size=2, **CONTINUOUS)
    assert workers[0].is_alive()  # the refused second LLM left the first one alone
    llm.close()
    llm.close()  # twice is harmless
    assert [p.exitcode for p in workers] == [0]
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)


def test_close_runs_the_release_hooks_before_the_group_is_destroyed():
    # On GPUs the hook destroys the CUDA graphs: NCCL's teardown waits until graphs holding its collectives are gone.
    llm = LLM("tiny", load_format="dummy", tensor_parallel_size=2, **CONTINUOUS)
    seen = []
    llm.engine.workers.on_shutdown(lambda: seen.append(torch.distributed.is_initialized()))
    llm.close()
    assert seen == [True]
    assert not torch.distributed.is_initialized()


def test_a_failing_release_hook_still_brings_the_group_down():
    llm = LLM("tiny", load_format="dummy", tensor_parallel_size=2, **CONTINUOUS)
    workers = llm.engine.workers.processes

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    llm.engine.workers.on_shutdown(broken)
    with pytest.warns(RuntimeWarning, match="illegal memory access"):
        llm.close()
    assert not torch.distributed.is_initialized()
    assert [p.exitcode for p in workers] == [0]  # told to stop, not killed


@pytest.mark.parametrize("value, message", [("ring", r"tp_all_reduce 'ring' is not supported; valid: .*symm_mem"),
                                            ("symm_mem", "symm_mem' needs CUDA GPUs .* run on cpu"),
                                            ("fused", "fused' needs CUDA GPUs .* run on cpu")])
def test_a_bad_all_reduce_choice_is_refused_before_any_process_starts(value, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny", load_format="dummy", tensor_parallel_size=2, tp_all_reduce=value, **CONTINUOUS)
    assert not torch.distributed.is_initialized()


def test_without_a_choice_a_cpu_engine_all_reduces_with_the_process_group():
    from minillm.parallel.all_reduce import chosen

    assert chosen("auto", torch.device("cpu"), 2) == "nccl"  # gloo's; "fused" needs GPUs that reach each other


CATCH_UP_SCRIPT = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import minillm.parallel.all_reduce as all_reduce

class Rendezvous:
    # symm_mem's two calls that _catch_up makes (it needs CUDA): which group each rendezvous went to
    def __init__(self):
        self.groups = []
    def empty(self, numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)
    def rendezvous(self, tensor, group_name):
        self.groups.append(group_name)

def run(rank, address, made, out):
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
    all_reduce._rendezvous_made = made[rank]
    symm_mem = Rendezvous()
    all_reduce._catch_up(symm_mem, torch.device("cpu"))
    alone = all(g != dist.group.WORLD.group_name for g in symm_mem.groups)
    with open(f"{out}/rank{rank}.txt", "w") as f:  # a file each: two processes' prints may interleave
        f.write(f"RANK {rank} count {all_reduce._rendezvous_made} made {len(symm_mem.groups)} alone {alone}")
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    address, out, made = f"tcp://127.0.0.1:{sys.argv[1]}", sys.argv[2], [int(n) for n in sys.argv[3:]]
    worker = mp.get_context("spawn").Process(target=run, args=(1, address, made, out))
    worker.start()
    run(0, address, made, out)
    worker.join()
"""


@pytest.mark.parametrize("made", [(3, 1), (0, 2), (2, 2)])
def test_a_rank_behind_catches_up_on_the_rendezvous_count_alone(tmp_path, made):
    """A driver that set up symmetric memory for an earlier engine has made more rendezvous than its new
    workers, and the next rendezvous's store keys are numbered by that count: whoever is behind makes the
    missing ones on a group of its own, so that every rank's next one has the same number."""
    from minillm.parallel.workers import _free_port

    script = tmp_path / "catch_up.py"
    script.write_text(CATCH_UP_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(_free_port()), str(tmp_path), *map(str, made)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert lines == [f"RANK {rank} count {max(made)} made {max(made) - made[rank]} alone True" for rank in (0, 1)]


TORCHRUN_SCRIPT = """
import torch
torch.set_num_threads(1)
from minillm import LLM, SamplingParams
llm = LLM("tiny", load_format="dummy", tensor_parallel_size=2, **{kwargs!r})
outs = llm.generate({prompts!r}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
print("TOKENS", [o.outputs[0].token_ids for o in outs])  # only rank 0 gets here
llm.close()
"""


def test_torchrun_rank0_drives_and_the_other_rank_serves(tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(TORCHRUN_SCRIPT.format(kwargs=CONTINUOUS, prompts=PROMPTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert printed == [f"TOKENS {generate('tiny', load_format='dummy')}"]


def test_a_worker_that_dies_before_joining_is_an_error_not_a_hang(tmp_path):
    """A script without the __main__ guard: the spawned worker re-imports it and dies while
    bootstrapping. Rank 0 must say so, not wait out the 30-minute rendezvous timeout."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from minillm import LLM\nLLM('tiny', load_format='dummy', tensor_parallel_size=2, **{CONTINUOUS!r})\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "rank 1 exited" in result.stderr and "__name__ == '__main__'" in result.stderr, result.stderr[-2000:]


RANK0_FAILS_SCRIPT = """
import minillm.parallel.tp as tp
from minillm import LLM
from minillm.parallel import workers

def out_of_memory(*args):
    raise MemoryError("rank 0 ran out of memory")

if __name__ == "__main__":  # rank 0 only (the spawned worker imports this file as __mp_main__)
    tp.row_parallel_rtn = out_of_memory  # fails before the all-reduce the worker waits in
    started = []
    spawn = workers.mp.get_context("spawn").Process.start
    workers.mp.get_context("spawn").Process.start = lambda self: (started.append(self), spawn(self))[1]
    try:
        LLM("tiny", load_format="dummy", tensor_parallel_size=2, quantization="rtn-int8", **{kwargs!r})
    except MemoryError as e:
        print("RAISED", e, "| workers alive:", [p.is_alive() for p in started])
"""


def test_rank0_failing_while_a_worker_waits_in_a_collective_raises_its_error_not_a_hang(tmp_path):
    """The worker sits in the all-reduce of a quantized layer's range, which rank 0 never reaches; a
    polite close (a message the worker would have to receive) would wait forever. On GPUs the same
    happens when rank 0 fails while the worker captures its CUDA graphs."""
    script = tmp_path / "rank0_fails.py"
    script.write_text(RANK0_FAILS_SCRIPT.format(kwargs=CONTINUOUS))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "RAISED rank 0 ran out of memory | workers alive: [False]" in result.stdout, result.stderr[-2000:]


# -- the shard arithmetic ------------------------------------------------------------------------


def rows(index: tuple[slice, ...], length: int) -> list[int]:
    return list(range(length))[index[0]]


def test_column_and_row_slices_tile_each_tensor_exactly():
    config = PRESETS["tiny"]  # 4 heads, 2 KV heads, head_dim 16, intermediate 128, vocab 512
    d, n = config.head_dim, 2
    sizes = {"q_proj": config.num_heads * d, "gate_proj": config.intermediate_size,
             "up_proj": config.intermediate_size, "embed_tokens": config.vocab_size, "lm_head": config.vocab_size,
             "k_proj": config.num_kv_heads * d}
    for module, length in sizes.items():
        parts = [rows(checkpoint_slice(f"model.layers.0.x.{module}.weight", config, Shard(r, n)), length)
                 for r in range(n)]
        assert sum(parts, []) == list(range(length)), module  # disjoint, in order, complete
    for module, inner in (("o_proj", config.num_heads * d), ("down_proj", config.intermediate_size)):
        index = [checkpoint_slice(f"model.layers.0.x.{module}.weight", config, Shard(r, n)) for r in range(n)]
        assert all(i[0] == slice(None) for i in index)  # every output row ...
        assert sum((list(range(inner))[i[1]] for i in index), []) == list(range(inner))  # ... of a column slice
        assert checkpoint_slice(f"model.layers.0.x.{module}.bias", config, Shard(0, n)) == (slice(None),)
    assert checkpoint_slice("model.norm.weight", config, Shard(1, n)) == (slice(None),)


def test_row_parallel_partial_products_sum_to_the_full_matmul():
    config, n = PRESETS["tiny"], 2
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(config.hidden_size, config.intermediate_size, generator=generator)
    x = torch.randn(3, config.intermediate_size, generator=generator)
    partials = []
    for r in range(n):
        index = checkpoint_slice("model.layers.0.mlp.down_proj.weight", config, Shard(r, n))
        partials.append(x[:, index[1]] @ weight[index].T)  # what rank r computes before the all-reduce
    torch.testing.assert_close(sum(partials), x @ weight.T)


@pytest.mark.parametrize("heads, kv_heads, n", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 4, 2), (6, 3, 3), (6, 2, 6)])
def test_each_rank_keeps_the_kv_heads_its_query_heads_read(heads, kv_heads, n):
    config = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=heads,
                         num_kv_heads=kv_heads, head_dim=2)
    group = heads // kv_heads  # query head h reads KV head h // group
    for r in range(n):
        local = shard_config(config, Shard(r, n))
        first, last = kv_head_range(config, Shard(r, n))
        assert last - first == local.num_kv_heads
        my_queries = range(r * local.num_heads, (r + 1) * local.num_heads)
        # Local query head j reads local KV head j // (local group), as the attention code assumes.
        local_group = local.num_heads // local.num_kv_heads
        for j, h in enumerate(my_queries):
            assert h // group == first + j // local_group


# -- errors --------------------------------------------------------------------------------------


def test_embedded_model_rejects_two_ranks_and_lists_the_valid_sizes():
    with pytest.raises(ValueError) as info:
        LLM(tensor_parallel_size=2, **CONTINUOUS)  # SmolLM2-135M: 9 heads, 3 KV heads
    message = str(info.value)
    assert "tensor_parallel_size=2" in message and "9 attention heads" in message
    assert "valid sizes for it: [1, 3]" in message


def test_impossible_layouts_name_the_valid_sizes():
    with pytest.raises(ValueError, match=r"4 attention heads .* valid sizes for it: \[1, 2, 4\]"):
        check_layout(PRESETS["tiny"], 3)
    odd_kv = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=12,
                         num_kv_heads=3, head_dim=2)
    with pytest.raises(ValueError, match=r"3 KV heads neither split into 4 .* \[1, 3, 6, 12\]"):
        check_layout(odd_kv, 4)
    assert valid_tp_sizes(PRESETS["llama3-8b"]) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_tensor_parallel_size_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=value)


@pytest.mark.parametrize("kwargs, needs", [(dict(batching="static"), "batching='continuous'"),
                                           (dict(batching="continuous", preemption_mode="swap"), "recompute")])
def test_tensor_parallel_needs_continuous_batching_without_swap(kwargs, needs):
    with pytest.raises(ValueError, match=needs):
        EngineConfig(tensor_parallel_size=2, **kwargs)


def test_more_ranks_than_gpus_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks need 2 GPUs .* torch sees 1"):
        _rank_device(torch.device("cuda"), 0, 2)
