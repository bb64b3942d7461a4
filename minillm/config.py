"""EngineConfig: every knob of the engine in one dataclass, named as vLLM names it where it can.

``LLM(model, **kwargs)`` forwards its keywords here, so ``LLM(max_num_seqs=16)`` and
``EngineConfig(max_num_seqs=16)`` mean the same thing. Values are checked at construction.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from minillm.kv.quant import check_kv_cache_dtype
from minillm.validation import InvalidArgumentType, check_float, check_int, describe

BATCHING_MODES = ("static", "dynamic", "continuous")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
PREEMPTION_MODES = ("recompute", "swap")
TP_ALL_REDUCES = ("auto", "nccl", "symm_mem", "fused")


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, .gguf file, preset name (with load_format="dummy"); None = embedded SmolLM2
    load_format: str = "auto"  # "auto" (read the files) | "dummy" (random weights of a preset's shape)
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA, float32 on CPU; or float16 / bfloat16 / float32
    device: str = "auto"  # "auto" = cuda when available, else cpu
    max_model_len: int | None = None  # prompt + output tokens per sequence; default min(model's, 2048)
    max_num_seqs: int | None = None  # sequences in one batch at most; default 8 static, 256 continuous
    max_num_batched_tokens: int = 2048  # token budget of one step; longer prompts are prefilled in chunks
    block_size: int = 16  # tokens per KV block (paged cache)
    num_kv_blocks: int | None = None  # explicit KV capacity in blocks, overriding the memory-derived one
    kv_cache_dtype: str = "auto"  # "auto" = the model's dtype; "int8" / "fp8" (e4m3): one scale per token
    #                               and KV head; "int4": groups of 16 channels (kv/quant.py). Quantized: continuous
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower value = more urgent; ties by arrival)
    #                                  | "lpm": admit the longest cached prefix first (needs enable_prefix_caching)
    preemption_mode: str = "recompute"  # a preempted request "recompute"s its prefill when readmitted,
    #                                     or "swap"s its KV blocks to CPU memory and back (continuous)
    swap_space: int | str = "4GiB"  # CPU memory for swapped-out KV blocks (preemption_mode="swap"), e.g. "512MiB"
    memory_budget: int | str | None = None  # emulate a smaller card: weights + workspace + KV must fit ("24GB")
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory minillm may use (without memory_budget)
    batching: str = "static"  # "static": fixed left-padded batches until the longest ends (contiguous KV)
    #                           "dynamic": static batches that wait for company and group similar lengths
    #                           "continuous": iteration-level scheduling over a paged KV cache
    batch_timeout: float = 0.05  # dynamic: seconds the oldest request waits for a full batch
    bucket_width: int = 128  # dynamic: prompts within the same multiple of this many tokens batch together
    attention_backend: str = "auto"  # paged attention: "torch" (reference) | "triton" (kernels); auto = triton on CUDA
    enable_prefix_caching: bool = False  # continuous: reuse cached KV of shared prompt prefixes (radix tree)
    enforce_eager: bool = False  # True: no CUDA graphs (continuous decode steps replay graphs on CUDA otherwise)
    num_scheduler_steps: int = 1  # continuous: a pure-decode batch runs up to this many forward passes per
    #                               scheduler step, each fed the last one's tokens on the device (multi_step.py)
    async_scheduling: bool | None = None  # continuous: launch a pure-decode batch's successor before reading its
    #                                       tokens, so the host's step overlaps the GPU's (MultiStepScheduler.chain);
    #                                       None: where it can run (continuous batching in one process)
    seed: int = 0  # seeds dummy weights and unseeded sampling
    tensor_parallel_size: int = 1  # processes (GPUs) each layer is split over; > 1 needs batching="continuous".
    #                                On GPUs every rank captures the same decode graphs, NCCL collectives inside
    tp_all_reduce: str = "auto"  # tensor parallelism's all-reduce: "nccl" (gloo on a CPU) | "symm_mem" (one-shot,
    #                              symmetric memory) | "fused" (into the next RMSNorm); auto = fused on GPUs that
    #                              are peers, else nccl (parallel/all_reduce.py)
    pipeline_parallel_size: int = 1  # processes (GPUs) the layers are split over, in stages; needs
    #                                  batching="continuous", runs eagerly, not with tensor_parallel_size > 1
    pipeline_micro_batches: int | None = None  # pipeline: a step's sequences flow through the stages in this
    #                                            many groups; default pipeline_parallel_size
    quantization: str | None = None  # quantize the weights on load: "rtn-int8" | "rtn-int4" | "gptq-int4" |
    #                                  "awq-int4" | "fp8", INT4 with -g64 / -channel ... (minillm.quant.spec);
    #                                  a quantized checkpoint loads as saved (give None or its own name)
    calibration_samples: int = 32  # gptq / awq on load: 512-token samples of the corpus's calibration part
    cpu_offload_gb: float = 0  # GiB of weights kept in CPU memory, whole decoder layers (the last ones), copied
    #                            in every forward pass (minillm/offload.py); the device keeps the rest + staging

    def __post_init__(self):
        if self.model is not None:
            if not isinstance(self.model, (str, os.PathLike)):
                raise InvalidArgumentType("model", f"model must be None (the embedded SmolLM2), a path or a preset "
                                                   f"name, got {describe(self.model)}")
            self.model = os.fspath(self.model)
        if not isinstance(self.device, str):
            raise InvalidArgumentType("device", f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                                                f"got {describe(self.device)}")
        self.seed = check_int("seed", self.seed, minimum=-2**63, below=2**64,  # torch.Generator's range
                              valid="an integer in [-2**63, 2**64)")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching {self.batching!r} is not supported; valid: {BATCHING_MODES}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy {self.scheduling_policy!r} is not supported; "
                             f"valid: {SCHEDULING_POLICIES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode {self.preemption_mode!r} is not supported; valid: {PREEMPTION_MODES}")
        if self.preemption_mode == "swap" and self.batching != "continuous":
            raise ValueError(f"preemption_mode='swap' needs batching='continuous' (now {self.batching!r}): "
                             f"only continuous batching preempts")
        if isinstance(self.swap_space, bool):
            raise ValueError(f"swap_space must be a memory size such as 4GiB, 512MiB or a byte count, "
                             f"got {self.swap_space!r}")
        try:
            self.swap_space = parse_bytes(self.swap_space)
        except ValueError:
            raise ValueError(f"swap_space {self.swap_space!r} is not a memory size; write e.g. 4GiB, 512MiB "
                             f"or a byte count > 0") from None
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not supported; valid: {ATTENTION_BACKENDS}")
        if self.tp_all_reduce not in TP_ALL_REDUCES:
            raise ValueError(f"tp_all_reduce {self.tp_all_reduce!r} is not supported; valid: {TP_ALL_REDUCES}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype != "auto" and self.batching != "continuous":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs batching='continuous' (the paged cache "
                             f"quantizes as it stores), got batching={self.batching!r}")
        if self.enable_prefix_caching and self.batching != "continuous":
            raise ValueError(f"enable_prefix_caching needs batching='continuous' (the paged cache), "
                             f"got batching={self.batching!r}")
        if self.scheduling_policy == "lpm" and not self.enable_prefix_caching:
            raise ValueError("scheduling_policy='lpm' orders waiting requests by their cached prefix, so it "
                             "needs enable_prefix_caching=True")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if self.batching == "continuous" else 8
        self.batch_timeout = check_float("batch_timeout", self.batch_timeout, minimum=0.0,
                                         valid="a number of seconds >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "bucket_width"):
            setattr(self, name, check_int(name, getattr(self, name), minimum=1, valid="a positive integer"))
        if self.num_kv_blocks is not None:
            self.num_kv_blocks = check_int("num_kv_blocks", self.num_kv_blocks, minimum=1,
                                           valid="None or a positive integer")
        if self.max_model_len is not None:
            self.max_model_len = check_int("max_model_len", self.max_model_len, minimum=2,
                                           valid="None or an integer >= 2")
        self.gpu_memory_utilization = check_float("gpu_memory_utilization", self.gpu_memory_utilization, above=0.0,
                                                  maximum=1.0, valid="a number in (0, 1]")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r} is not supported; valid: 'auto', 'cpu', 'cuda', 'cuda:N'")
        if self.memory_budget is not None:
            self.memory_budget = parse_bytes(self.memory_budget)
        if self.quantization is not None:
            from minillm.quant.spec import QuantSpec

            self.quantization = QuantSpec.parse(self.quantization).name  # ValueError lists the valid names
        if isinstance(self.calibration_samples, bool) or not isinstance(self.calibration_samples, int) \
                or self.calibration_samples < 1:
            raise ValueError(f"calibration_samples must be a positive integer, got {self.calibration_samples!r}")
        if isinstance(self.cpu_offload_gb, bool) or not isinstance(self.cpu_offload_gb, (int, float)) \
                or not self.cpu_offload_gb >= 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0 (0 = no offload), got {self.cpu_offload_gb!r}")
        counts = ["tensor_parallel_size", "pipeline_parallel_size"]
        if self.pipeline_micro_batches is not None:
            counts.append("pipeline_micro_batches")
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} with pipeline_parallel_size="
                             f"{self.pipeline_parallel_size}: minillm splits a model one way at a time; "
                             f"set one of them to 1")
        parallel = [name for name in ("tensor_parallel_size", "pipeline_parallel_size") if getattr(self, name) > 1]
        if parallel:
            # Only the paged runner broadcasts its steps to the other ranks; the CPU swap space
            # would have to move every rank's KV blocks, not just rank 0's.
            if self.batching != "continuous":
                raise ValueError(f"{parallel[0]} > 1 needs batching='continuous', got {self.batching!r}")
            if self.quantization is not None and self.quantization.startswith(("gptq", "awq")):
                # Calibration runs whole layers, one after the other: no rank holds them (tp.py).
                raise ValueError(f"quantization={self.quantization!r} calibrates on the whole model, which no rank "
                                 f"holds with {parallel[0]} > 1: quantize in one process, save it with "
                                 f"minillm.quant.checkpoint.save_quantized(LLM(model, quantization="
                                 f"{self.quantization!r}), folder), then load LLM(folder, {parallel[0]}=...)")
            spec = QuantSpec.parse(self.quantization) if self.quantization is not None else None
            if spec is not None and spec.method == "fp8" and self.tensor_parallel_size > 1:
                raise ValueError(f"quantization={self.quantization!r} with tensor_parallel_size="
                                 f"{self.tensor_parallel_size}: fp8 scales each token's activations by their largest "
                                 f"value over all input channels, which o_proj and down_proj split over ranks; use "
                                 f"rtn-int8 or an INT4 method, or pipeline_parallel_size")
            if spec is not None and spec.lm_head and self.tensor_parallel_size > 1:
                raise ValueError(f"quantization={self.quantization!r} with tensor_parallel_size="
                                 f"{self.tensor_parallel_size}: -head quantizes the LM head, which tensor parallelism "
                                 f"splits by vocabulary (a layer -head does not quantize); drop -head")
            if self.preemption_mode != "recompute":
                raise ValueError(f"{parallel[0]} > 1 needs preemption_mode='recompute', "
                                 f"got {self.preemption_mode!r}")
            if self.cpu_offload_gb:  # the offloader hooks one process's whole model, not a shard or a stage
                raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb} with {parallel[0]} > 1 is not supported; "
                                 f"offload in one process (cpu_offload_gb) or split the model, not both")
        if isinstance(self.num_scheduler_steps, bool) or not isinstance(self.num_scheduler_steps, int) \
                or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be a positive integer (1 = one forward pass per scheduler "
                             f"step), got {self.num_scheduler_steps!r}")
        if self.num_scheduler_steps > 1 and self.batching != "continuous":
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} needs batching='continuous' (a static "
                             f"batch has no scheduler step to repeat), got batching={self.batching!r}")
        if self.num_scheduler_steps > 1 and self.pipeline_parallel_size > 1:
            # A stage would need the last stage's sampled tokens before its next micro-batch: not built.
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} with pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} is not supported; use num_scheduler_steps=1 "
                             f"or tensor_parallel_size")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (where it can run), "
                             f"got {self.async_scheduling!r}")
        one_process = self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1
        if self.async_scheduling and (self.batching != "continuous" or not one_process):
            # The other ranks would need each chained batch's first ids, which only rank 0's device holds.
            raise ValueError(f"async_scheduling=True needs batching='continuous' in one process, got batching="
                             f"{self.batching!r}, tensor_parallel_size={self.tensor_parallel_size}, "
                             f"pipeline_parallel_size={self.pipeline_parallel_size}")
        if self.async_scheduling is None:
            self.async_scheduling = self.batching == "continuous" and one_process
        if self.pipeline_parallel_size > 1:
            # Micro-batches hand activations between processes mid-step: no graph spans that.
            self.enforce_eager = True
        if self.pipeline_micro_batches is not None and self.pipeline_parallel_size == 1:
            raise ValueError(f"pipeline_micro_batches={self.pipeline_micro_batches} needs pipeline_parallel_size "
                             f"> 1 (a single process has no pipeline to fill)")
        if self.pipeline_micro_batches is None and self.pipeline_parallel_size > 1:
            self.pipeline_micro_batches = self.pipeline_parallel_size


def resolve_device(device: str) -> torch.device:
    """``EngineConfig.device`` as a torch device: "auto" is CUDA where torch sees it, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA device; use 'cpu'")
    return torch.device(device)


def parse_bytes(value: int | str) -> int:
    """'24GB' -> 24e9, '512MiB' -> 512 * 2**20, 1000 -> 1000."""
    if isinstance(value, int) and value > 0:
        return value
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in units or float(match.group(1)) <= 0:
        raise ValueError(f"memory size {value!r} is not understood; write e.g. 24GB, 512MiB or a byte count")
    return int(float(match.group(1)) * units[match.group(2).lower()])
