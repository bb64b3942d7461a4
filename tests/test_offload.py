"""CPU weight offload (cpu_offload_gb): greedy tokens equal the resident model's, the offloaded layers'
tensors live in host buffers outside a forward pass and in the staging buffers inside it, the weights
are read from host memory every step, the KV capacity grows by what leaves the device, and bad values
raise errors that name them. On a GPU, the copies captured in the decode graphs too."""

from __future__ import annotations

import json

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.cli import main
from minillm.config import EngineConfig
from test_continuous import DEVICE, sharpen, tiny_engine  # tests/ is on sys.path
from test_cuda_graphs import needs_cuda, run_staggered

TINY_LAYER_GIB = 0.0001  # a tiny layer in fp32 is ~148 KB: this offloads one layer, twice it both


def random_prompts(n: int, seed: int, vocab: int = 500) -> tuple[list[list[int]], list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (int(k),), generator=generator).tolist()
               for k in torch.randint(1, 30, (n,), generator=generator)]
    return prompts, torch.randint(1, 20, (n,), generator=generator).tolist()


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def holds(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes lie inside ``buffer``'s."""
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + buffer.nbytes


@pytest.mark.parametrize("batching", ["continuous", "static"])
@pytest.mark.parametrize("layers", [1, 2])
def test_tiny_continuous_batch_gives_the_resident_tokens(batching, layers):
    prompts, max_tokens = random_prompts(8, seed=layers)
    # A tight cache and a small token budget: preemptions and chunked prefills while offloading.
    kwargs = dict(batching=batching, max_num_seqs=5)
    if batching == "continuous":
        kwargs |= dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24)
    results = []
    for gb in (0, layers * TINY_LAYER_GIB):
        llm = LLM("tiny", load_format="dummy", dtype="float32", device=DEVICE, cpu_offload_gb=gb, **kwargs)
        sharpen(llm.engine)
        results.append(greedy(llm, prompts, max_tokens))
    assert llm.engine.offloader.indices == [0, 1][2 - layers:]  # the last layers
    assert len(llm.engine.offloader.staging) == layers  # one layer needs one staging buffer, not two
    assert results[1] == results[0]


@pytest.mark.parametrize("quantization", ["rtn-int4", "fp8"])
def test_quantized_layers_offload_their_packed_codes(quantization):
    prompts, max_tokens = random_prompts(4, seed=7)
    results = []
    for gb in (0, 1e-5):  # a quantized tiny layer holds 21 (int4) to 37 (fp8) KB: one layer
        llm = LLM("tiny", load_format="dummy", dtype="float32", device=DEVICE, batching="continuous",
                  quantization=quantization, cpu_offload_gb=gb, num_kv_blocks=64)  # (on a GPU: not all its memory)
        sharpen(llm.engine)
        results.append(greedy(llm, prompts, max_tokens))
    offloader = llm.engine.offloader
    codes = llm.engine.model.model.layers[1].mlp.down_proj
    codes = codes.qweight if quantization == "rtn-int4" else codes.weight
    assert offloader.indices == [1] and codes.dtype in (torch.int32, torch.float8_e4m3fn)
    assert holds(offloader.host[0], codes)
    assert results[1] == results[0]


@pytest.fixture(scope="module")
def smollm_pair():
    """The embedded SmolLM2 (fp32, CPU, continuous) under a 1 GB card: resident, and with 0.05 GiB
    (four 13.5 MiB layers, so staging buffers get refilled) offloaded."""
    kwargs = dict(dtype="float32", device="cpu", batching="continuous", memory_budget="1GB")
    return LLM(**kwargs), LLM(cpu_offload_gb=0.05, **kwargs)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three prime numbers are", "Once upon a time"]


def test_smollm2_batch_gives_the_resident_tokens(smollm_pair):
    resident, offloaded = smollm_pair
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, params, use_tqdm=False)]
    assert offloaded.engine.offloader.indices == [26, 27, 28, 29]
    got = [o.outputs[0].token_ids for o in offloaded.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected


def test_offloaded_tensors_live_in_host_buffers_and_run_from_staging(smollm_pair):
    resident, offloaded = smollm_pair
    engine, offloader = offloaded.engine, offloaded.engine.offloader
    layers = engine.model.model.layers
    for j, index in enumerate(offloader.indices):
        for tensor in offloader.tensors[j]:
            assert holds(offloader.host[j], tensor) and not any(holds(s, tensor) for s in offloader.staging)
    for layer in layers[:offloader.indices[0]]:
        for tensor in layer.parameters():
            assert not any(holds(buffer, tensor) for buffer in offloader.staging + offloader.host)
    seen = []

    def check(j):  # registered after the offloader's hooks, so it runs after them, just before the layer
        def hook(module, args):
            seen.append(j)
            for tensor in module.parameters():
                assert holds(offloader.staging[j % 2], tensor)
        return hook

    handles = [layers[i].register_forward_pre_hook(check(j)) for j, i in enumerate(offloader.indices)]
    try:
        offloaded.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [0, 1, 2, 3] * 2  # one prefill, one decode
    for tensor in layers[offloader.indices[-1]].parameters():  # back in host memory after the pass
        assert holds(offloader.host[-1], tensor)


def test_weights_are_read_from_host_memory_every_step(smollm_pair):
    _, offloaded = smollm_pair
    offloader = offloaded.engine.offloader
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = offloaded.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    for buffer in offloader.staging:  # garbage left in the staging buffers: every layer is copied before use
        buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8))
    assert offloaded.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    down = offloaded.engine.model.model.layers[offloader.indices[-1]].mlp.down_proj.weight
    saved = down.clone()
    down.mul_(-3)  # changes the host copy: the next step must compute with it
    try:
        assert offloaded.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids != expected
    finally:
        down.copy_(saved)
    assert offloaded.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_kv_capacity_grows_by_what_leaves_the_device(smollm_pair):
    resident, offloaded = smollm_pair
    engine, offloader = offloaded.engine, offloaded.engine.offloader
    layer_bytes = [sum(p.nbytes for p in layer.parameters()) for layer in resident.engine.model.model.layers]
    # The fewest last layers that hold 0.05 GiB, counted on the resident model.
    assert sum(layer_bytes[-3:]) < 0.05 * 2**30 <= sum(layer_bytes[-4:]) == engine.offloaded_weight_bytes
    assert 2 * layer_bytes[-1] <= offloader.staging_bytes < 2 * layer_bytes[-1] + 2 * 256 * 16  # + alignment
    assert offloader.bytes_per_step >= engine.offloaded_weight_bytes
    freed = engine.offloaded_weight_bytes - offloader.staging_bytes
    assert freed > 25 * 2**20  # two of the four layers' worth
    block_bytes = engine.kv_bytes_per_token * engine.config.block_size
    grown = (engine.kv_capacity_tokens - resident.engine.kv_capacity_tokens) * engine.kv_bytes_per_token
    assert abs(grown - freed) < block_bytes


@pytest.mark.parametrize("value, match", [(-1, "cpu_offload_gb must be a number of GiB >= 0.*-1"),
                                          ("4GiB", "cpu_offload_gb must be a number.*'4GiB'"),
                                          (True, "cpu_offload_gb must be a number.*True"),
                                          (float("nan"), "cpu_offload_gb must be a number.*nan")])
def test_bad_values_are_named(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(cpu_offload_gb=value)


def test_more_than_the_layers_hold_names_the_valid_range():
    with pytest.raises(ValueError, match=r"cpu_offload_gb=1 is more than the 2 decoder layers' weights "
                                         r"\(295,936 bytes\); valid: 0 to 0.000275\d* GiB"):
        LLM("tiny", load_format="dummy", dtype="float32", device="cpu", cpu_offload_gb=1)
    with pytest.raises(ValueError, match="cpu_offload_gb=1 with tensor_parallel_size > 1 is not supported"):
        EngineConfig(batching="continuous", tensor_parallel_size=2, cpu_offload_gb=1)


def test_bench_offload_json(tmp_path, capsys):
    out = tmp_path / "offload.json"
    main(["bench", "offload", "--model", "tiny", "--load-format", "dummy", "--dtype", "float32", "--scale", "cpu",
          "--cpu-offload-gb", str(2 * TINY_LAYER_GIB), "--num-requests", "3", "--latency-runs", "1",
          "--memory-budget", "300MiB", "--output", str(out)])
    result = json.loads(out.read_text())
    for key in ("benchmark", "workload", "model", "device", "date", "command", "commit", "runs",
                "h2d_bandwidth_gbs", "hbm_bandwidth_gbs"):
        assert key in result, key
    assert list(result["runs"]) == ["0GiB", "0.0002GiB"]  # 0 GiB runs first, as the reference
    base, run = result["runs"].values()
    assert base["decode_ratio"] == base["throughput_ratio"] == 1.0 and base["pcie_bytes_per_step"] == 0
    assert run["offloaded_layers"] == [0, 1] and run["pcie_bytes_per_step"] >= run["offloaded_weight_bytes"] > 0
    assert run["pcie_ms_per_step"] > 0 and run["latency"]["mean_decode_tok_s"] > 0
    assert run["throughput"]["completed"] == 3 and run["greedy_agreement"] == 1.0
    assert run["decode_ratio"] == pytest.approx(run["latency"]["mean_decode_tok_s"]
                                                / base["latency"]["mean_decode_tok_s"])
    # Both layers offloaded, and two staging buffers of one layer each: nothing left the device.
    assert run["staging_bytes"] >= run["offloaded_weight_bytes"] and run["kv_capacity_tokens"] > 0
    assert "PCIe MB/step" in capsys.readouterr().out
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_cuda
def test_graph_replay_with_offload_gives_the_resident_tokens():
    prompts, max_tokens = random_prompts(12, seed=3)
    results = {}
    for gb in (0, 0.1):  # smollm2-135m's fp32 layers are 13.5 MiB: 8 layers offloaded
        for eager in (True, False):
            engine = tiny_engine(model="smollm2-135m", device="cuda", batching="continuous", block_size=4,
                                 enforce_eager=eager, cpu_offload_gb=gb, num_kv_blocks=200,
                                 max_num_batched_tokens=24, max_num_seqs=10)
            results[gb, eager] = run_staggered(engine, prompts, max_tokens)
    offloader = engine.offloader
    assert len(offloader.indices) == 8 and engine.runner.graphs.num_replays > 10
    assert all(t.device.type == "cpu" and t.is_pinned() for tensors in offloader.tensors for t in tensors)
    assert all(buffer.is_cuda for buffer in offloader.staging)
    assert results[0.1, True] == results[0, True] and results[0.1, False] == results[0, False]


@needs_cuda
def test_slow_copies_and_stale_staging_cannot_change_the_graph_tokens(monkeypatch):
    """Each copy starts after ~1 ms of spinning on the side stream, and the staging buffers start out
    as garbage: a layer that ran before its copy landed (a missing wait, in a graph or eagerly) would
    compute with stale or random weights and change the tokens."""
    from minillm import offload
    copy_in = offload.LayerOffloader._copy_in

    def slow_copy_in(self, j):
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(2_000_000)  # clock cycles
        copy_in(self, j)

    prompts, max_tokens = random_prompts(8, seed=5)
    kwargs = dict(model="smollm2-135m", device="cuda", batching="continuous", block_size=4, num_kv_blocks=200,
                  max_num_batched_tokens=24, max_num_seqs=10)
    resident = run_staggered(tiny_engine(**kwargs), prompts, max_tokens)
    monkeypatch.setattr(offload.LayerOffloader, "_copy_in", slow_copy_in)
    engine = tiny_engine(cpu_offload_gb=0.1, **kwargs)
    for buffer in engine.offloader.staging:
        buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, device=buffer.device))
    assert run_staggered(engine, prompts, max_tokens) == resident
    assert engine.runner.graphs.num_replays > 10
