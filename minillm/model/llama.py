"""One decoder for the whole Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 and SmolLM2.

They differ only by switches in ``ModelConfig`` (GQA, qkv bias, q/k RMSNorm, llama3 RoPE scaling,
tied embeddings), so one readable file covers them all. Module names follow Hugging Face's
(``model.layers.0.self_attn...``), except that q/k/v and gate/up are fused into one matrix each
(``qkv_proj``, ``gate_up_proj``) as vLLM does: one kernel launch instead of three (or two), which
matters because an eager decode step is bound by launches, not by the GPU (see
``minillm.bench.profile``). ``checkpoint_tensor`` says where each Hugging Face tensor lives.

The model never sees requests or cache layouts: each layer hands its q, k, v to an *attention
context* (``attn(layer_idx, q, k, v)``) that the runner builds for the step. The context stores
K/V wherever its cache lives (contiguous, paged, ...) and returns the attention output. Swapping
the KV cache therefore never touches this file.

This is the reference: plain torch ops. The Triton backend swaps these modules for the subclasses in
``fused.py`` (fused norm, RoPE and SiLU kernels, GEMVs, norms folded into INT4 GEMVs), which compute
the same thing in fewer kernels.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.config import ModelConfig
from minillm.model.dense import Linear


class AttentionContext(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H, D], k/v: [B, T, Hkv, D] for the new tokens -> [B, T, H, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with ``residual``: (norm(x + residual), x + residual) — the add fused in."""
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        # Normalise in fp32, multiply the weight in the input dtype: the exact order transformers
        # uses, so bf16 results match the oracle bit for bit where possible.
        dtype = x.dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """theta_i = base^(-2i/d), with Llama 3's frequency-dependent scaling when configured.

    Llama 3 (Meta's reference `apply_scaling`): wavelengths longer than original_len/low_freq_factor
    are slowed by `factor`, shorter than original_len/high_freq_factor kept, and the band between
    interpolated smoothly.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, D]; cos/sin: [B, T, 1, D] (the half-split layout HF checkpoints use)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.qkv_proj = Linear(h, (self.num_heads + 2 * self.num_kv_heads) * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv_proj's output [B, T, (H + 2 Hkv) D] -> (q and k together [B, T, H + Hkv, D], v), q/k normed."""
        B, T, _ = qkv.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = qkv.view(B, T, H + 2 * Hkv, self.head_dim)
        if self.q_norm is None:
            qk, v = qkv.split([H + Hkv, Hkv], dim=2)
            return qk, v
        q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=2), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        qk, v = self.split_heads(self.qkv_proj(x))
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=2)  # one pass over both
        out = attn(self.layer_idx, q, k, v).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, attn: AttentionContext, residual: torch.Tensor | None = None):
        """-> (mlp_out, residual). The layer's output hidden state is their sum, but the add is left to
        the next norm (the next layer's input_layernorm, or the final norm), which fuses it as vLLM's
        ``fused_add_rms_norm`` does: one kernel fewer per layer, and the sum is rounded to the dtype
        before it is normalised exactly as transformers' ``x + mlp_out`` is. The first layer gets the
        embedding as x and no residual; every later one the previous layer's (mlp_out, residual)."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm(x, residual=residual)  # residual = x + residual
        attn_out = self.self_attn(normed, cos, sin, attn)
        normed, residual = self.post_attention_layernorm(attn_out, residual=residual)  # residual += attn_out
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Hugging Face projection -> (minillm's fused projection, its index among the fused parts).
FUSED_PROJECTIONS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                     "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.post_init()

    def post_init(self) -> None:
        """Tie the embeddings and compute the RoPE frequencies (fp32). Called again after
        ``to_empty``, which allocates storage without data and unties shared parameters."""
        head_quantized = getattr(getattr(self, "quant_spec", None), "lm_head", False)  # ("-head": a layer of its own)
        if self.config.tie_word_embeddings and not head_quantized:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The buffer's device, not lm_head's: a pipeline stage before the last has no LM head.
        self.inv_freq = rope_inverse_frequencies(self.config).to(self.inv_freq.device)

    def enable_fused_kernels(self, enabled: bool = True) -> None:
        """Swap in (or back out) the fused-kernel layers of ``fused.py``: the Triton backend's decoder."""
        from minillm.model import fused  # imports triton: only when asked for

        fused.enable(self, enabled)

    def checkpoint_tensor(self, name: str) -> torch.Tensor:
        """The tensor (a view) that holds Hugging Face checkpoint tensor ``name``:
        ``model.layers.3.self_attn.k_proj.weight`` -> the k rows of ``...self_attn.qkv_proj.weight``.
        Raises AttributeError for a name this model has no place for."""
        prefix, _, rest = name.rpartition(".")  # rest = "weight" | "bias"
        module_path, _, proj = prefix.rpartition(".")
        if proj not in FUSED_PROJECTIONS:
            return self.get_parameter(name)
        fused, part = FUSED_PROJECTIONS[proj]
        sizes = self.fused_sizes(fused)
        start = sum(sizes[:part])
        return self.get_parameter(f"{module_path}.{fused}.{rest}")[start:start + sizes[part]]

    def fused_sizes(self, fused: str) -> list[int]:
        """Output rows of each part of a fused projection: q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``."""
        c = self.config
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def checkpoint_names(self) -> list[str]:
        """Every tensor name a Hugging Face checkpoint of this model holds (tied head excluded)."""
        names = []
        for name, _ in self.named_parameters():  # shared (tied) parameters are listed once
            prefix, _, rest = name.rpartition(".")
            module_path, _, proj = prefix.rpartition(".")
            parts = [p for p, (fused, _) in FUSED_PROJECTIONS.items() if fused == proj]
            names += [f"{module_path}.{p}.{rest}" for p in parts] if parts else [name]
        return names

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        """input_ids, positions: [B, T] -> final hidden states [B, T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)  # once per step, shared by every layer
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, cos, sin, attn, residual)
        return self.model.norm(x, residual=residual)[0]  # the last layer's add, fused into the final norm

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, head_dim] for positions [B, T]: computed in fp32, then rounded like HF."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]  # broadcast over heads

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 (sampling and comparisons want full precision)."""
        return self.lm_head(hidden).float()
