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
the KV cache therefore never touches this file. (The Triton paged context may also take over RoPE, which
it applies in its KV store's kernel: ``AttentionContext``.)
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minillm.config import switched_on
from minillm.model.config import ModelConfig
from minillm.model import norm_folding
from minillm.model.dense import Linear, gemv_choice, takes_gated
from minillm.model.norm_folding import (NormedRow, PendingNorm, PendingRows, PendingSlot, ResidualRow, folds_norms,
                                        residual_stream)


# MINILLM_ROPE_TABLE=0: a GPU computes RoPE's cos and sin from the positions every step (``rope``), as a CPU does.
ROPE_TABLE = switched_on("MINILLM_ROPE_TABLE")


class AttentionContext(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [B, T, H, D], k/v: [B, T, Hkv, D] for the new tokens -> [B, T, H, D].

        A context whose ``takes_rope`` is true also takes ``rope=(cos, sin)`` ([B * T, D] each) with q and k
        not yet rotated, and rotates them as the fused RoPE kernel would (in place), in the kernel that
        stores K and V: one launch fewer per layer. The model passes it only with its fused kernels on."""
        ...


class RMSNorm(nn.Module):
    fused_ops = None  # minillm.kernels.fused_layer_ops once enable_fused_kernels() is called
    # Tensor parallelism with MINILLM_TP_ALLREDUCE=fused: x with a residual is a row-parallel linear's
    # unreduced output, and this sums it over the ranks in the norm's kernel (parallel/all_reduce.py).
    reduce_input = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor | ResidualRow, residual: torch.Tensor | None = None):
        """norm(x), or with ``residual``: (norm(x + residual), x + residual) — the add fused in. A ``ResidualRow``
        (a GEMV added the residual, ``norm_folding.py``): (its ``NormedRow``, its row), and no kernel runs here."""
        if isinstance(x, ResidualRow):
            assert residual is None, "a ResidualRow already holds the residual"
            return NormedRow(x, self), x.total
        # The residual may be the fp32 stream of folded norms (norm_folding.py): the fused kernel rounds it to x's
        # dtype as it loads it; the other paths round it first (a no-op when the dtypes already agree).
        if residual is not None and self.reduce_input is not None and self.reduce_input.fits(x):
            return self.reduce_input(x, self.weight, self.eps, residual.to(x.dtype))
        if self.fused_ops is not None:
            return self.fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual.to(x.dtype)
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
    fused_ops = None
    # Set by LlamaForCausalLM.fold_norms where qkv_proj may leave its input norm's 1 / rms to the decode kernel.
    pending_slot: PendingSlot | None = None

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

    def forward(self, x, cos, sin, attn: AttentionContext, add_to: torch.Tensor | None = None):
        """With ``add_to`` (the residual, norms folded: ``norm_folding.py``): o_proj's ``ResidualRow``. With x a
        ``NormedRow``, a ``pending_slot`` and a context that ``takes_pending_norm``, qkv_proj may leave its norm's
        1 / rms to the decode kernel (a ``PendingNorm``, whose fp32 row q, k and v are views of)."""
        B, T, _ = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        pending = None
        if (self.pending_slot is not None and isinstance(x, NormedRow) and self.fused_ops is not None
                and getattr(attn, "takes_pending_norm", False)):
            qkv = self.qkv_proj(x, into=self.pending_slot)
            pending = qkv if isinstance(qkv, PendingNorm) else None
            qkv = qkv.row if pending is not None else qkv
        else:
            qkv = self.qkv_proj(x)
        qkv = qkv.view(B, T, H + 2 * Hkv, self.head_dim)
        if self.q_norm is not None:
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)
        else:
            qk, v = qkv.split([H + Hkv, Hkv], dim=2)
        rope = None
        if self.fused_ops is not None:
            token_cos, token_sin = cos.flatten(0, 1)[:, 0], sin.flatten(0, 1)[:, 0]
            if getattr(attn, "takes_rope", False):  # the context rotates q and k in the kernel storing K and V
                rope = (token_cos, token_sin)
            else:  # one kernel, in place, over every query and key head
                rows = qk.flatten(0, 1)
                self.fused_ops.rope(rows, token_cos, token_sin, out=rows)
        else:
            qk = apply_rope(qk, cos, sin)  # one pass over query and key heads
        q, k = qk.split([H, Hkv], dim=2)
        if pending is not None:  # (takes_pending_norm promised a context that takes rope)
            out = attn(self.layer_idx, q, k, v, rope=rope, pending=pending)
        else:
            out = attn(self.layer_idx, q, k, v) if rope is None else attn(self.layer_idx, q, k, v, rope=rope)
        out = out.reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out) if add_to is None else self.o_proj(out, add_to=add_to)


class MLP(nn.Module):
    fused_ops = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, add_to: torch.Tensor | None = None, pending: PendingSlot | None = None):
        """With ``add_to`` (the residual, norms folded: ``norm_folding.py``): down_proj's ``ResidualRow``. With
        ``pending`` (x a ``NormedRow``): gate_up_proj may leave its norm's 1 / rms to down_proj, in that slot."""
        extra = {} if add_to is None else {"add_to": add_to}
        if self.fused_ops is not None:
            gate_up = self.gate_up_proj(x) if pending is None else self.gate_up_proj(x, into=pending)
            if isinstance(gate_up, PendingNorm):  # down_proj's GEMV scales it, then SiLU-and-multiply
                return self.down_proj(gate_up, gated=True, **extra)
            if takes_gated(self.down_proj, gate_up):  # one row: down_proj's GEMV applies SiLU-and-multiply itself
                return self.down_proj(gate_up, gated=True, **extra)
            return self.down_proj(self.fused_ops.silu_and_mul(gate_up), **extra)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, **extra)


class DecoderLayer(nn.Module):
    # Set by LlamaForCausalLM.fold_norms: o_proj adds the residual for the post-attention norm, which gate_up_proj
    # applies (fold_attention_norm), or leaves to down_proj in this slot (mlp_slot); down_proj adds the residual
    # for the next layer's input norm (fold_mlp_norm).
    fold_attention_norm = fold_mlp_norm = False
    mlp_slot: PendingSlot | None = None

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, attn, residual: torch.Tensor | None = None):
        """-> (mlp_out, residual). The layer's output hidden state is their sum, but the add is left to
        the next norm (the next layer's input_layernorm, or the final norm), which fuses it as vLLM's
        ``fused_add_rms_norm`` does: one kernel fewer per layer, and the sum is rounded to the dtype
        before it is normalised exactly as transformers' ``x + mlp_out`` is. The first layer gets the
        embedding as x and no residual; every later one the previous layer's (mlp_out, residual).
        Under tensor parallelism mlp_out is down_proj's all-reduced output, or with the fused all-reduce
        (``parallel/all_reduce.py``) its unreduced one, which the next norm sums. With the norms folded
        (``norm_folding.py``) at one row, mlp_out may be a ``ResidualRow`` (down_proj added the residual) and the
        residual then None."""
        if residual is None and not isinstance(x, ResidualRow):
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm(x, residual=residual)  # residual = x + residual
        one_row = normed.shape[0] * normed.shape[1] == 1
        if self.fold_attention_norm and one_row:  # o_proj's GEMV adds the residual; gate_up_proj's normalises
            attn_out = self.self_attn(normed, cos, sin, attn, add_to=residual_stream(residual))
            normed, residual = self.post_attention_layernorm(attn_out)
            mlp = {} if self.mlp_slot is None else {"pending": self.mlp_slot}  # 1 / rms left to down_proj
        else:
            attn_out = self.self_attn(normed, cos, sin, attn)
            normed, residual = self.post_attention_layernorm(attn_out, residual=residual)  # residual += attn_out
            mlp = {}
        if self.fold_mlp_norm and one_row:  # down_proj's GEMV adds the residual; the next qkv_proj's normalises
            return self.mlp(normed, add_to=residual_stream(residual), **mlp), None
        return self.mlp(normed, **mlp), residual


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
        self._rope_tables = {}  # (dtype, device) -> rope_table's table, built again from these frequencies

    def enable_fused_kernels(self, enabled: bool = True) -> None:
        """Run RMSNorm (+ residual add), RoPE and SiLU-and-multiply as Triton kernels
        (``kernels/fused_layer_ops.py``) instead of chains of small torch ops, and one-row products of the
        dense linears as minillm's GEMV (``dense.py``; MINILLM_GEMV=cublas keeps cuBLAS for them). Where it can,
        fewer kernels still: at one row down_proj's GEMV applies SiLU-and-multiply itself (``dense.takes_gated``),
        and an attention context that ``takes_rope`` applies RoPE in its KV store."""
        ops = gemv = None
        if enabled:
            from minillm.kernels import fused_layer_ops as ops  # imports triton: only when asked for
            if gemv_choice() == "triton":
                from minillm.kernels import gemv
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused_ops = ops
            if hasattr(module, "gemv"):  # dense.Linear and the tensor-parallel layers built on dense.product
                module.gemv = gemv
        self.fold_norms(enabled and norm_folding.ENABLED)

    pending_rows: PendingRows | None = None  # fold_norms's, where gate_up_proj and qkv_proj leave their 1 / rms
    fold_first_norm = False  # fold_norms's: layer 0's qkv_proj normalises the embedding itself (FOLD_FIRST_NORM)

    def fold_norms(self, enabled: bool = True) -> None:
        """At one row, fold each RMSNorm that sits between two projections that fold norms (INT4 on an H100/H200:
        ``norm_folding.py``) into their GEMVs: the post-attention norm between o_proj and gate_up_proj, the input
        norm between a layer's down_proj and the next layer's qkv_proj (not the last layer's: the final norm and the
        LM head follow it), and the first layer's input norm, whose row is the embedding (``FOLD_FIRST_NORM``).
        ``enable_fused_kernels`` calls this: without the fused kernels a fold would only fall back to torch
        (``QuantLinear._folded``). Where down_proj folds norms too (and ``DEFER_MLP_NORM``), gate_up_proj leaves the
        post-attention norm's 1 / rms to it, in a slot of ``pending_rows``; and where the input norm is folded (and
        ``DEFER_ATTENTION_NORM``), qkv_proj leaves its 1 / rms to the decode attention kernel."""
        layers = self.model.layers
        # Layer 0's input norm as well: the embedding is then the fp32 stream's first row (forward), which qkv_proj
        # normalises as it reads it, as every later layer's does; only where the layer folds its next norm too (not
        # with a row-parallel o_proj: tensor parallelism folds nothing).
        first = layers[0].self_attn if len(layers) else None
        self.fold_first_norm = (enabled and norm_folding.FOLD_FIRST_NORM and first is not None
                                and folds_norms(first.qkv_proj) and folds_norms(first.o_proj))
        mlp_deferred, attention_deferred = [], []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            layer.fold_attention_norm = enabled and folds_norms(attn.o_proj) and folds_norms(mlp.gate_up_proj)
            layer.fold_mlp_norm = (enabled and i + 1 < len(layers) and folds_norms(mlp.down_proj)
                                   and folds_norms(layers[i + 1].self_attn.qkv_proj))
            if layer.fold_attention_norm and norm_folding.DEFER_MLP_NORM and folds_norms(mlp.down_proj):
                mlp_deferred.append(i)
            input_folded = layers[i - 1].fold_mlp_norm if i else self.fold_first_norm
            if input_folded and norm_folding.DEFER_ATTENTION_NORM and attn.q_norm is None:
                attention_deferred.append(i)
            layer.mlp_slot = attn.pending_slot = None
        self.pending_rows = None
        if mlp_deferred or attention_deferred:
            from minillm.kernels.hopper.w4_gemv import splits_needed  # (folds_norms said the kernels run here)

            # A slot for each split a GEMV can have: the most, at one tile a program.
            parts = {name: (proj.out_features, splits_needed(proj.in_features, 1)) for name, proj, deferred in
                     (("gate_up", layers[0].mlp.gate_up_proj, mlp_deferred),
                      ("qkv", layers[0].self_attn.qkv_proj, attention_deferred)) if deferred}
            self.pending_rows = PendingRows(len(layers), parts, self.inv_freq.device)
            for i in mlp_deferred:
                layers[i].mlp_slot = self.pending_rows.slot(i, "gate_up")
            for i in attention_deferred:
                layers[i].self_attn.pending_slot = self.pending_rows.slot(i, "qkv")

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
        one_row, embed, residual = positions.numel() == 1, self.model.embed_tokens, None
        if one_row and self.fold_first_norm and type(embed) is nn.Embedding:
            from minillm.kernels.fused_layer_ops import step_start  # (fold_first_norm: the fused kernels are on)

            cos, sin = self.rope(positions, embed.weight.dtype)  # first: the GEMV behind step_start may start early
            to_zero = None if self.pending_rows is None else self.pending_rows.buffer
            x = ResidualRow(step_start(input_ids, embed.weight, to_zero))  # the fp32 stream's row; slots zeroed
        else:
            if self.pending_rows is not None and one_row:
                self.pending_rows.clear()  # every slot zeroed for gate_up_proj's and qkv_proj's GEMVs to add to
            x = embed(input_ids)
            cos, sin = self.rope(positions, x.dtype)  # once per step, shared by every layer
            if self.fold_first_norm and one_row:  # (no embedding: a pipeline stage after the first, x the stream)
                x = ResidualRow(x.float())  # the stream's first row; layer 0's input norm runs in its qkv_proj's GEMV
        for layer in self.model.layers:
            x, residual = layer(x, cos, sin, attn, residual)
        return self.model.norm(x, residual=residual)[0]  # the last layer's add, fused into the final norm

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, head_dim] for positions [B, T]: computed in fp32, then rounded like HF. On a GPU, rows
        of a table computed once (``rope_table``): one gather a step instead of seven small kernels."""
        gathered = self.rope_rows(positions, dtype) if positions.is_cuda and ROPE_TABLE else None
        return gathered if gathered is not None else self.rope_values(positions, dtype)

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``rope``'s cos and sin gathered from ``rope_table``, as views (equal strides, contiguous along head_dim);
        None for a row of more positions than the table holds (a perplexity or calibration window past
        max_position_embeddings, which no engine limit bounds), which ``rope`` then computes. An engine's steps stay
        below max_position_embeddings."""
        table = self.rope_table(dtype)
        if positions.shape[-1] > table.shape[0]:
            return None
        rows = table.index_select(0, positions.reshape(-1)).view(*positions.shape, 2, -1)
        return rows[:, :, 0:1], rows[:, :, 1:2]

    def rope_values(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope``'s cos and sin computed from the positions."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]  # broadcast over heads

    def rope_table(self, dtype: torch.dtype) -> torch.Tensor:
        """[max_position_embeddings, 2, head_dim]: every position's cos and sin (``rope_values``), built on first use
        (a step before any CUDA graph capture: the graphs' warm-up runs eager). The same elementwise kernels on the
        same device compute each entry as they would a step's, so a gathered row is bit for bit the computed one
        (tests/test_rope_table.py checks every position). Not on the CPU, whose vectorised cos may round a lane
        differently from its scalar tail."""
        key = (dtype, self.inv_freq.device)
        if key not in self._rope_tables:
            limit = self.config.max_position_embeddings  # (the engine refuses a longer max_model_len)
            positions = torch.arange(limit, device=self.inv_freq.device)[None]
            cos, sin = self.rope_values(positions, dtype)
            self._rope_tables[key] = torch.stack((cos[0, :, 0], sin[0, :, 0]), dim=1)
        return self._rope_tables[key]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 (sampling and comparisons want full precision)."""
        return self.lm_head(hidden).float()
