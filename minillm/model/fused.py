"""The decoder on minillm's fused kernels: ``llama.py``'s layers, swapped in module by module.

Why a file of its own: ``llama.py`` is the reference a learner reads, in plain torch ops. The Triton
backend computes the same layers in fewer kernels, and every such step lives here, in a subclass of
the reference layer it replaces:

- RMSNorm (+ the residual add), RoPE and SiLU-and-multiply as Triton kernels
  (``kernels/fused_layer_ops.py``), and one-row products of the dense linears as minillm's GEMV
  (``dense.py``); at one row down_proj's GEMV applies SiLU-and-multiply itself (``dense.takes_gated``),
  and an attention context that ``takes_rope`` applies RoPE in its KV store.
- On a GPU, RoPE's cos and sin gathered from a table computed once (``rope_table``): one gather a
  step instead of seven small kernels.
- At one row, the norms between INT4 projections folded into their GEMVs (``norm_folding.py``).
- Under tensor parallelism, the all-reduce summed in the norm's kernel (``parallel/all_reduce.py``
  sets ``reduce_input``).

``enable`` swaps each module's class (its parameters stay where they are), and back: the reference
and the fused decoder never share an ``if``.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.model import llama
from minillm.model.dense import takes_gated
from minillm.model.norm_folding import (NormedRow, PendingNorm, PendingRows, PendingSlot, ResidualRow, folds_norms,
                                        residual_stream)


class FusedRMSNorm(llama.RMSNorm):
    fused_ops = None  # minillm.kernels.fused_layer_ops while enabled
    # Tensor parallelism with tp_all_reduce="fused": x with a residual is a row-parallel linear's
    # unreduced output, and this sums it over the ranks in the norm's kernel (parallel/all_reduce.py).
    reduce_input = None

    def forward(self, x: torch.Tensor | ResidualRow, residual: torch.Tensor | None = None):
        """As ``RMSNorm``; a ``ResidualRow`` (a GEMV added the residual, ``norm_folding.py``) gives (its ``NormedRow``,
        its row), and no kernel runs here."""
        if isinstance(x, ResidualRow):
            assert residual is None, "a ResidualRow already holds the residual"
            return NormedRow(x, self), x.total
        # The residual may be the fp32 stream of folded norms: the fused kernel rounds it to x's dtype as it loads
        # it; the other paths round it first (a no-op when the dtypes already agree).
        if residual is not None and self.reduce_input is not None and self.reduce_input.fits(x):
            return self.reduce_input(x, self.weight, self.eps, residual.to(x.dtype))
        if self.fused_ops is not None:
            return self.fused_ops.rms_norm(x, self.weight, self.eps, residual)
        return super().forward(x, None if residual is None else residual.to(x.dtype))


class FusedAttention(llama.Attention):
    fused_ops = None
    # Set by fold_norms where qkv_proj may leave its input norm's 1 / rms to the decode kernel.
    pending_slot: PendingSlot | None = None

    def forward(self, x, cos, sin, attn, add_to: torch.Tensor | None = None):
        """With ``add_to`` (the residual, norms folded): o_proj's ``ResidualRow``. With x a ``NormedRow``, a
        ``pending_slot`` and a context that ``takes_pending_norm``, qkv_proj may leave its norm's 1 / rms to the
        decode kernel (a ``PendingNorm``, whose fp32 row q, k and v are views of). A context that ``takes_rope``
        rotates q and k (``rope=(cos, sin)``, [B * T, D] each) in the kernel that stores K and V."""
        B, T, _ = x.shape
        pending = None
        if self.pending_slot is not None and isinstance(x, NormedRow) and getattr(attn, "takes_pending_norm", False):
            qkv = self.qkv_proj(x, into=self.pending_slot)
            pending = qkv if isinstance(qkv, PendingNorm) else None
            qkv = qkv.row if pending is not None else qkv
        else:
            qkv = self.qkv_proj(x)
        qk, v = self.split_heads(qkv)
        token_cos, token_sin = cos.flatten(0, 1)[:, 0], sin.flatten(0, 1)[:, 0]
        rope = None
        if getattr(attn, "takes_rope", False):  # the context rotates q and k in the kernel storing K and V
            rope = (token_cos, token_sin)
        else:  # one kernel, in place, over every query and key head
            rows = qk.flatten(0, 1)
            self.fused_ops.rope(rows, token_cos, token_sin, out=rows)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=2)
        if pending is not None:  # (takes_pending_norm promised a context that takes rope)
            out = attn(self.layer_idx, q, k, v, rope=rope, pending=pending)
        else:
            out = attn(self.layer_idx, q, k, v) if rope is None else attn(self.layer_idx, q, k, v, rope=rope)
        out = out.reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out) if add_to is None else self.o_proj(out, add_to=add_to)


class FusedMLP(llama.MLP):
    fused_ops = None

    def forward(self, x, add_to: torch.Tensor | None = None, pending: PendingSlot | None = None):
        """With ``add_to`` (the residual, norms folded): down_proj's ``ResidualRow``. With ``pending`` (x a
        ``NormedRow``): gate_up_proj may leave its norm's 1 / rms to down_proj, in that slot."""
        extra = {} if add_to is None else {"add_to": add_to}
        gate_up = self.gate_up_proj(x) if pending is None else self.gate_up_proj(x, into=pending)
        if isinstance(gate_up, PendingNorm):  # down_proj's GEMV scales it, then SiLU-and-multiply
            return self.down_proj(gate_up, gated=True, **extra)
        if takes_gated(self.down_proj, gate_up):  # one row: down_proj's GEMV applies SiLU-and-multiply itself
            return self.down_proj(gate_up, gated=True, **extra)
        return self.down_proj(self.fused_ops.silu_and_mul(gate_up), **extra)


class FusedDecoderLayer(llama.DecoderLayer):
    # Set by fold_norms: o_proj adds the residual for the post-attention norm, which gate_up_proj applies
    # (fold_attention_norm), or leaves to down_proj in this slot (mlp_slot); down_proj adds the residual for the
    # next layer's input norm (fold_mlp_norm).
    fold_attention_norm = fold_mlp_norm = False
    mlp_slot: PendingSlot | None = None

    def forward(self, x, cos, sin, attn, residual: torch.Tensor | None = None):
        """As ``DecoderLayer``. Under tensor parallelism mlp_out may be down_proj's unreduced output, which the
        next norm sums (``reduce_input``). With the norms folded at one row, mlp_out may be a ``ResidualRow``
        (down_proj added the residual) and the residual then None."""
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


class FusedLlamaForCausalLM(llama.LlamaForCausalLM):
    pending_rows: PendingRows | None = None  # fold_norms's, where gate_up_proj and qkv_proj leave their 1 / rms
    fold_first_norm = False  # fold_norms's: layer 0's qkv_proj normalises the embedding itself

    def post_init(self) -> None:
        super().post_init()
        self._rope_tables = {}  # (dtype, device) -> rope_table's table, built again from the new frequencies

    def fold_norms(self, enabled: bool = True) -> None:
        """At one row, fold each RMSNorm that sits between two projections that fold norms (INT4 on an H100/H200:
        ``norm_folding.py``) into their GEMVs: the post-attention norm between o_proj and gate_up_proj, the input
        norm between a layer's down_proj and the next layer's qkv_proj (not the last layer's: the final norm and the
        LM head follow it), and the first layer's input norm, whose row is the embedding. Where down_proj folds norms
        too, gate_up_proj leaves the post-attention norm's 1 / rms to it, in a slot of ``pending_rows``; and where
        the input norm is folded, qkv_proj leaves its 1 / rms to the decode attention kernel."""
        layers = self.model.layers
        # Layer 0's input norm as well: the embedding is then the fp32 stream's first row (forward), which qkv_proj
        # normalises as it reads it, as every later layer's does; only where the layer folds its next norm too (not
        # with a row-parallel o_proj: tensor parallelism folds nothing).
        first = layers[0].self_attn if len(layers) else None
        self.fold_first_norm = enabled and first is not None and folds_norms(first.qkv_proj) and folds_norms(
            first.o_proj)
        mlp_deferred, attention_deferred = [], []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            layer.fold_attention_norm = enabled and folds_norms(attn.o_proj) and folds_norms(mlp.gate_up_proj)
            layer.fold_mlp_norm = (enabled and i + 1 < len(layers) and folds_norms(mlp.down_proj)
                                   and folds_norms(layers[i + 1].self_attn.qkv_proj))
            if layer.fold_attention_norm and folds_norms(mlp.down_proj):
                mlp_deferred.append(i)
            input_folded = layers[i - 1].fold_mlp_norm if i else self.fold_first_norm
            if input_folded and attn.q_norm is None:
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``; with the first norm folded, a one-row step starts with
        ``step_start`` (``kernels/fused_layer_ops.py``), which writes the embedding as the fp32 stream's row and
        zeroes the pending rows."""
        one_row, embed, residual = positions.numel() == 1, self.model.embed_tokens, None
        if one_row and self.fold_first_norm and type(embed) is nn.Embedding:
            from minillm.kernels.fused_layer_ops import step_start

            cos, sin = self.rope(positions, embed.weight.dtype)  # first: the GEMV behind step_start may start early
            to_zero = None if self.pending_rows is None else self.pending_rows.buffer
            x = ResidualRow(step_start(input_ids, embed.weight, to_zero))  # the fp32 stream's row; slots zeroed
        else:
            if self.pending_rows is not None and one_row:
                self.pending_rows.clear()  # every slot zeroed for gate_up_proj's and qkv_proj's GEMVs to add to
            x = embed(input_ids)
            cos, sin = self.rope(positions, x.dtype)
            if self.fold_first_norm and one_row:  # (no embedding: a pipeline stage after the first, x the stream)
                x = ResidualRow(x.float())  # the stream's first row; layer 0's input norm runs in its qkv_proj's GEMV
        for layer in self.model.layers:
            x, residual = layer(x, cos, sin, attn, residual)
        return self.model.norm(x, residual=residual)[0]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """On a GPU, rows of a table computed once (``rope_table``); elsewhere ``rope_values``."""
        gathered = self.rope_rows(positions, dtype) if positions.is_cuda else None
        return gathered if gathered is not None else self.rope_values(positions, dtype)

    def rope_values(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's cos and sin, computed from the positions."""
        return llama.LlamaForCausalLM.rope(self, positions, dtype)

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``rope``'s cos and sin gathered from ``rope_table``, as views (equal strides, contiguous along head_dim);
        None for a row of more positions than the table holds (a perplexity or calibration window past
        max_position_embeddings, which no engine limit bounds), which ``rope`` then computes."""
        table = self.rope_table(dtype)
        if positions.shape[-1] > table.shape[0]:
            return None
        rows = table.index_select(0, positions.reshape(-1)).view(*positions.shape, 2, -1)
        return rows[:, :, 0:1], rows[:, :, 1:2]

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


SWAPS = {llama.RMSNorm: FusedRMSNorm, llama.Attention: FusedAttention, llama.MLP: FusedMLP,
         llama.DecoderLayer: FusedDecoderLayer, llama.LlamaForCausalLM: FusedLlamaForCausalLM}
REFERENCE = {fused: reference for reference, fused in SWAPS.items()}


def enable(model: llama.LlamaForCausalLM, enabled: bool = True) -> None:
    """Swap ``model``'s layers for the fused ones (``enabled``) or back to the reference, and point every layer's
    ``gemv`` at ``kernels/gemv.py`` (or None)."""
    ops = gemv = None
    if enabled:
        from minillm.kernels import fused_layer_ops as ops, gemv
    swap = SWAPS if enabled else REFERENCE
    for module in model.modules():
        keeps_reduce = isinstance(module, FusedRMSNorm) and module.reduce_input is not None  # (fuse_norm's)
        if type(module) in swap and not keeps_reduce:
            module.__class__ = swap[type(module)]
        if isinstance(module, (FusedRMSNorm, FusedAttention, FusedMLP)):
            module.fused_ops = ops
        if hasattr(module, "gemv"):  # dense.Linear and the tensor-parallel layers built on dense.product
            module.gemv = gemv
    if enabled:
        model._rope_tables = {}
        model.fold_norms()


def fuse_norm(norm: llama.RMSNorm, reduce_input) -> None:
    """Give ``norm`` the tensor-parallel all-reduce to sum its input with (None: take it back)."""
    if type(norm) is llama.RMSNorm:
        norm.__class__ = FusedRMSNorm
    norm.reduce_input = reduce_input
