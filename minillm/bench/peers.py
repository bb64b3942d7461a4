"""The peers minillm is measured against, run in the same process on the same workload.

``hf_static``: transformers' ``model.generate`` on left-padded static batches — the naive
deployment. ``hf_cb``: transformers' own continuous batching (paged attention), each request added
with its own ``max_new_tokens``. The transformers model is built from minillm's own config and *shares minillm's weight
tensors* (module names match), so both engines compute with identical weights and no extra memory,
and greedy outputs can be compared token for token. (minillm fuses q/k/v and gate/up; the
transformers model gets views of the fused matrices.)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from minillm.bench.metrics import RequestTiming
from minillm.bench.workloads import WorkloadRequest
from minillm.model.config import ModelConfig, hf_config_for


def hf_model_sharing_weights(model: torch.nn.Module, config: ModelConfig):
    """A transformers CausalLM whose parameters are minillm's tensors (no copy)."""
    from transformers import AutoModelForCausalLM

    spec = getattr(model, "quant_spec", None)
    if spec is not None:
        raise ValueError(f"the transformers peers share minillm's dense weights, and this model is quantized "
                         f"({spec.name}); run the peers without --quantization, or --peers with none")

    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config_for(config), dtype=dtype)
    for name, _ in list(hf.named_parameters(remove_duplicate=False)):
        module_name, _, leaf = name.rpartition(".")
        source = "model.embed_tokens.weight" if name == "lm_head.weight" and config.tie_word_embeddings else name
        # A view into minillm's (possibly fused) parameter: same storage, no copy.
        view = model.checkpoint_tensor(source)
        hf.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)
    # RoPE frequencies are buffers computed at construction, on the meta device: rebuild those modules.
    for name, module in list(hf.named_modules()):
        if name.endswith("rotary_emb"):
            parent, _, leaf = name.rpartition(".")
            hf.get_submodule(parent)._modules[leaf] = type(module)(module.config).to(device)
    return hf.eval()


class _StepClock:
    """A transformers streamer that only records when each step's tokens exist."""

    def __init__(self, device: torch.device):
        self.device, self.times, self._prompt_seen = device, [], False

    def put(self, value):
        if not self._prompt_seen:  # generate() first "streams" the prompt itself
            self._prompt_seen = True
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.inference_mode()
def run_hf_static(hf_model, workload: list[WorkloadRequest], batch_size: int, pad_token_id: int = 0,
                  progress=None) -> tuple[list[RequestTiming], list[list[int]], float]:
    """Fixed batches of ``batch_size`` in arrival order, left-padded, each generating its longest
    request's output length (shorter requests are cut afterwards, as a static server would)."""
    from transformers import GenerationConfig

    device = next(hf_model.parameters()).device
    timings, tokens = [], []
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        longest = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, longest - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, longest - len(r.prompt_token_ids):] = 1
        max_new = max(r.max_tokens for r in batch)
        # eos_token_id=None: run every step (ignore_eos) without touching the logits.
        generation = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                      pad_token_id=pad_token_id)
        clock = _StepClock(device)
        out = hf_model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=generation,
                                streamer=clock)
        for row, r in enumerate(batch):
            timings.append(RequestTiming(start, clock.times[:r.max_tokens], len(r.prompt_token_ids)))
            tokens.append(out[row, longest:longest + r.max_tokens].tolist())
        if progress is not None:
            progress.update(len(batch))
    return timings, tokens, time.perf_counter() - start


def run_hf_continuous(hf_model, workload: list[WorkloadRequest],
                      num_blocks: int | None = None) -> tuple[list[RequestTiming], list[list[int]], float]:
    """transformers' continuous batching manager, as its documentation shows it. Its warm-up runs
    when the manager starts, before the clock; token times come from its own timestamps
    (``time.perf_counter``, like ours). Not under ``torch.inference_mode``: the manager updates
    tensors from a background thread, where inference mode does not reach (transformers 5.17 fails).

    ``num_blocks``: its KV cache in blocks (of 256 tokens) and a batch of at most the workload's prompt
    tokens (transformers' ``ContinuousBatchingConfig``, as in 5.25); None, the benchmarks' setting, lets it
    size both from free memory (on a CPU that is gigabytes of attention mask, filled before it starts:
    half a minute)."""
    import transformers
    from packaging.version import Version
    from transformers import GenerationConfig

    if Version(transformers.__version__) < Version("5.18"):
        hf_model.set_attn_implementation("paged|sdpa")  # later versions switch to paged attention themselves
    generation = GenerationConfig(max_new_tokens=max(r.max_tokens for r in workload), do_sample=False,
                                  eos_token_id=None, pad_token_id=0)  # no EOS: every request runs its length
    sizes = {}
    if num_blocks is not None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        max_batch_tokens = sum(len(r.prompt_token_ids) for r in workload)
        sizes["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=num_blocks,
                                                                       max_batch_tokens=max_batch_tokens)
    results = {}
    with hf_model.continuous_batching_context_manager(generation_config=generation, **sizes) as manager:
        start = time.perf_counter()
        for i, r in enumerate(workload):
            manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.max_tokens,
                                record_timestamps=True)
        while len(results) < len(workload):
            output = manager.get_result(timeout=600)
            if output is None:
                raise RuntimeError(f"transformers' continuous batching stopped after {len(results)} of "
                                   f"{len(workload)} requests")
            if output.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed request {output.request_id}: "
                                   f"{output.error}")
            if output.is_finished():
                results[output.request_id] = output
        duration = time.perf_counter() - start
    outputs = [results[str(i)] for i in range(len(workload))]
    timings = [RequestTiming(start, list(o.timestamps), len(r.prompt_token_ids)) for o, r in zip(outputs, workload)]
    return timings, [list(o.generated_tokens) for o in outputs], duration


def write_hf_checkpoint(preset: str, path: str | Path, dtype: str = "bfloat16", device: str = "cpu",
                        shard_bytes: int = 2 << 30) -> Path:
    """A Hugging Face model directory with a minillm preset's shape and random weights, for a peer that loads its
    model from disk (``transformers serve``). No EOS token (in the config and the generation config), so every
    request runs to its ``max_tokens``, as ``ignore_eos`` makes minillm do; and a word-level tokenizer with one
    word per token id (``"t5 t17 ..."``), so a workload's token ids travel as text and come back as the same ids.

    The model is built on the meta device and each tensor is drawn on ``device`` and written straight to a
    safetensors shard (``model-XXXXX-of-YYYYY.safetensors`` with its index), so a 7B checkpoint costs the time to
    write 13 GB and never holds more than one shard in host memory."""
    import json

    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from minillm.model.config import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config_for(PRESETS[preset])
    config.eos_token_id = config.bos_token_id = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    config.architectures = [type(model).__name__]  # what a server reads to pick the model class
    config.save_pretrained(path)
    model.generation_config.save_pretrained(path)

    plan, size = [[]], 0  # shard the names by their sizes first, so that each shard is drawn and written alone
    for name, meta in model.state_dict().items():  # tied weights appear once
        nbytes = meta.numel() * meta.element_size()
        if plan[-1] and size + nbytes > shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, meta))
        size += nbytes
    generator = torch.Generator(device).manual_seed(0)
    weight_map, total = {}, 0
    for i, names in enumerate(plan):
        shard = {}
        for name, meta in names:
            tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            if meta.dim() == 1:
                tensor.fill_(1.0)  # norm weights
            else:
                tensor.normal_(0.0, config.initializer_range, generator=generator)
            shard[name] = tensor.cpu()
            total += tensor.nbytes
        filename = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        save_file(shard, path / filename, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, filename)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(path)
    return path
