"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples one token per row.

For static batching the batch is left-padded: row b's prompt sits at the right end of the first
``L`` columns (``L`` = longest prompt), so every row writes its next token into the same cache
column. The runner keeps that column and which columns hold real tokens; it never decides who runs.
"""

from __future__ import annotations

import torch

from minillm.kv.contiguous import ContiguousKVCache, LeftPaddedBatch
from minillm.model.llama import LlamaForCausalLM
from minillm.sampling import Sampler
from minillm.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, max_batch: int, max_model_len: int, device: torch.device,
                 seed: int = 0):
        self.model, self.device = model, device
        dtype = model.lm_head.weight.dtype
        self.cache = ContiguousKVCache(model.config, max_batch, max_model_len, dtype, device)
        self.sampler = Sampler(device, seed)
        self.key_valid: torch.Tensor | None = None  # [B, max_model_len] for the batch in flight
        self.pad: torch.Tensor | None = None  # [B] left-padding per row
        self.next_col = 0  # the cache column the next decode token goes to

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        if batch.is_prefill:
            input_ids, positions, attn = self._prepare_prefill(batch)
        else:
            input_ids, positions, attn = self._prepare_decode(batch)
        hidden = self.model(input_ids, positions, attn)
        logits = self.model.compute_logits(hidden[:, -1])
        return self.sampler(logits, batch.requests)

    def _prepare_prefill(self, batch: ScheduledBatch):
        prompts = [r.prompt_token_ids for r in batch.requests]
        longest = max(map(len, prompts))
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        positions = torch.zeros(len(prompts), longest, dtype=torch.long)
        key_valid = torch.zeros(len(prompts), self.cache.max_len, dtype=torch.bool)
        pad = torch.tensor([longest - len(p) for p in prompts])
        for row, prompt in enumerate(prompts):
            ids[row, pad[row]:] = torch.tensor(prompt)
            positions[row, pad[row]:] = torch.arange(len(prompt))
            key_valid[row, pad[row]:longest] = True
        self.key_valid = key_valid.to(self.device)
        self.pad = pad.to(self.device)
        self.next_col = longest
        attn = LeftPaddedBatch(self.cache, self.key_valid, start=0, num_new=longest)
        return ids.to(self.device), positions.to(self.device), attn

    def _prepare_decode(self, batch: ScheduledBatch):
        col = self.next_col
        if col >= self.cache.max_len:
            raise RuntimeError(f"static batch ran past the cache's {self.cache.max_len} columns (scheduler bug)")
        ids = torch.tensor([[r.last_token_id] for r in batch.requests], device=self.device)
        positions = (col - self.pad)[:, None]
        self.key_valid[:, col] = True
        self.next_col += 1
        return ids, positions, LeftPaddedBatch(self.cache, self.key_valid, start=col, num_new=1)
