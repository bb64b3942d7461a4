"""Quantized weights under tensor and pipeline parallelism on the CPU: gloo, two processes.

The promise is the usual one, with the same quantization on both sides: greedy outputs with
``tensor_parallel_size=2`` or ``pipeline_parallel_size=2`` are token for token those of one process.
Checked for RTN quantized on load by each rank from its own shard (INT4 in groups, INT4 and INT8 per
output channel, whose row-parallel ranges are all-reduced) and FP8 per stage, and for GPTQ
checkpoints read shard-wise (with and without act-order). Beyond tokens, rank 0's dequantized
weights are exactly its part of one process's. Plus the checkpoint shard arithmetic (each rank's
packed codes, scales and zero points reassemble into the whole tensors) and the errors for layouts
that cannot split.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.model.config import PRESETS, ModelConfig
from minillm.model.loader import read_hf_config
from minillm.parallel.tp import Shard, check_layout, checkpoint_slice, valid_tp_sizes
from minillm.quant.calibration import LINEARS
from minillm.quant.checkpoint import QUANTIZED_TENSORS, packed_index, projections, read_quantized, save_quantized
from minillm.quant.linear import unpack
from minillm.quant.spec import QuantSpec

CONTINUOUS = dict(dtype="float32", device="cpu", batching="continuous", attention_backend="torch", max_model_len=128)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7], [3], [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262, 263], [8, 9]]
MODES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def dequantized_projections(model) -> dict[str, torch.Tensor]:
    """Each quantized linear's weight [out, in] as its Hugging Face projection(s): fused ones split."""
    weights = {}
    for i, layer in enumerate(model.model.layers):
        for path in LINEARS:
            rows = projections(model, path)
            parts = layer.get_submodule(path).dequantized_weight().split([n for _, n in rows])
            weights |= {f"model.layers.{i}.{name}.weight": w for (name, _), w in zip(rows, parts)}
    return weights


def assert_rank0_holds_its_part(llm: LLM, whole: dict[str, torch.Tensor]) -> None:
    """Rank 0's dequantized weights are bit for bit its part of one process's ``whole`` ones."""
    engine = llm.engine
    mine = dequantized_projections(engine.model)
    assert mine  # rank 0 holds quantized layers
    for name, weight in mine.items():
        index = (slice(None),) if engine.stage is not None else \
            checkpoint_slice(name, engine.workers.model_config, engine.workers.part)
        assert torch.equal(weight, whole[name][index]), name


# -- RTN and FP8 quantized on load: each rank its own part ---------------------------------------


@pytest.mark.parametrize("quantization, modes", [("rtn-int4-g32", ("tp", "pp")), ("rtn-int8", ("tp", "pp")),
                                                 ("rtn-int4-channel", ("tp",)), ("fp8", ("pp",))])
def test_quantized_on_load_splits_into_the_one_process_model(quantization, modes):
    kwargs = dict(load_format="dummy", quantization=quantization, **CONTINUOUS)
    with LLM("tiny", **kwargs) as llm:
        expected = tokens(llm)
        whole = dequantized_projections(llm.engine.model)
    with LLM("tiny", load_format="dummy", **CONTINUOUS) as dense:
        assert tokens(dense) != expected  # the quantization shows in the tokens: matching them means something
    for mode in modes:
        with LLM("tiny", **kwargs, **{MODES[mode]: 2}) as llm:
            assert llm.engine.quantization == quantization
            assert tokens(llm) == expected, mode
            assert_rank0_holds_its_part(llm, whole)


# -- GPTQ checkpoints, read shard-wise ------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, make_tiny_hf):
    """A tiny Qwen2: q/k/v biases, one KV head (replicated over two ranks), tied embeddings, and a
    vocabulary of 301 (vocab-parallel slices of 151 and 150)."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("qwen2")
    make_tiny_hf(Qwen2Config, seed=7, num_key_value_heads=1, tie_word_embeddings=True,
                 vocab_size=301).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(qwen2_dir, tmp_path_factory):
    """method -> (checkpoint folder, the one-process quantized model's tokens and dequantized weights)."""
    saved = {}
    for method in ("gptq-int4-g32-noact", "gptq-int4-g32", "rtn-int8", "rtn-int4-channel"):
        with LLM(str(qwen2_dir), quantization=method, calibration_samples=2, **CONTINUOUS) as llm:
            folder = save_quantized(llm, tmp_path_factory.mktemp(method))
            saved[method] = folder, tokens(llm), dequantized_projections(llm.engine.model)
    return saved


def test_gptq_checkpoint_tp2_reads_its_shard_and_matches_one_process(checkpoints):
    folder, expected, whole = checkpoints["gptq-int4-g32-noact"]
    with LLM(str(folder), tensor_parallel_size=2, **CONTINUOUS) as llm:
        assert llm.engine.quantization == "gptq-int4-g32-noact"
        o_proj = llm.engine.model.model.layers[0].self_attn.o_proj
        assert (o_proj.in_features, o_proj.scales.shape[0]) == (32, 1)  # 2 of 4 heads: one group of 32
        assert tokens(llm) == expected
        assert_rank0_holds_its_part(llm, whole)


def test_act_order_checkpoint_runs_in_a_pipeline_but_cannot_split_by_rows(checkpoints):
    folder, expected, whole = checkpoints["gptq-int4-g32"]
    with LLM(str(folder), pipeline_parallel_size=2, **CONTINUOUS) as llm:
        assert llm.engine.model.model.layers[0].mlp.down_proj.perm is not None  # act-order kept
        assert tokens(llm) == expected
        assert_rank0_holds_its_part(llm, whole)
    with pytest.raises(ValueError, match=r"with gptq-int4-g32 weights: its act-order .* gptq-int4-noact"):
        LLM(str(folder), tensor_parallel_size=2, **CONTINUOUS)


@pytest.mark.parametrize("method", ["gptq-int4-g32-noact", "rtn-int8", "rtn-int4-channel"])
def test_rank_parts_of_a_checkpoint_reassemble_into_the_whole(checkpoints, method):
    folder = checkpoints[method][0]
    spec = QuantSpec.parse(method)
    config = read_hf_config(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = sorted({n.rpartition(".")[0] for n in f.keys() if n.endswith(".qweight")})
        assert len(names) == 7 * config.num_layers
        for linear in names:
            whole = {kind: f.get_tensor(f"{linear}.{kind}") for kind in QUANTIZED_TENSORS}
            parts = [{kind: read_quantized(f, f"{linear}.{kind}", spec, config, Shard(r, 2))[1]
                      for kind in QUANTIZED_TENSORS} for r in range(2)]
            for r, part in enumerate(parts):  # each part dequantizes to its slice of the whole weight
                index = checkpoint_slice(f"{linear}.weight", config, Shard(r, 2))
                assert torch.equal(dequantize_v1(part, spec.bits), dequantize_v1(whole, spec.bits)[index]), linear
            assert_parts_reassemble(linear, whole, parts, per_channel=spec.group_size == -1)


def dequantize_v1(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """w[n, k] = (q[k, n] - (qzeros[g_idx[k], n] + 1)) * scales[g_idx[k], n], from the v1 layout's definition."""
    codes = unpack(tensors["qweight"], bits)
    zeros = (unpack(tensors["qzeros"].t(), bits).t() + 1) & (2 ** bits - 1)
    groups = tensors["g_idx"].long()
    return ((codes - zeros[groups]) * tensors["scales"][groups].float()).t()


def assert_parts_reassemble(linear: str, whole: dict, parts: list[dict], per_channel: bool) -> None:
    """The ranks' raw tensors put back together are the whole ones."""
    if linear.endswith(("k_proj", "v_proj")):  # the one KV head: every rank holds all of it
        assert all(torch.equal(p[kind], whole[kind]) for p in parts for kind in QUANTIZED_TENSORS), linear
    elif not linear.endswith(("o_proj", "down_proj")):  # column-parallel: output channels side by side
        for kind in ("qweight", "scales", "qzeros"):
            assert torch.equal(torch.cat([p[kind] for p in parts], dim=1), whole[kind]), (linear, kind)
        assert all(torch.equal(p["g_idx"], whole["g_idx"]) for p in parts), linear
    else:  # row-parallel: input channels one after the other, in whole groups
        assert torch.equal(torch.cat([p["qweight"] for p in parts]), whole["qweight"]), linear
        for kind in ("scales", "qzeros"):
            if per_channel:  # one group per output channel: every rank holds all of it
                assert all(torch.equal(p[kind], whole[kind]) for p in parts), (linear, kind)
            else:
                assert torch.equal(torch.cat([p[kind] for p in parts]), whole[kind]), (linear, kind)
        groups_per_rank = 0 if per_channel else parts[0]["scales"].shape[0]
        renumbered = torch.cat([p["g_idx"] + r * groups_per_rank for r, p in enumerate(parts)])
        assert torch.equal(renumbered, whole["g_idx"]), linear


# -- errors --------------------------------------------------------------------------------------


def test_groups_split_by_ranks_are_refused_before_any_process_starts_with_the_sizes_that_fit():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not fit this model with rtn-int4 weights: "
                                         r"each rank's 32 input channels of o_proj are not whole groups of 128 "
                                         r"\(rtn-int4-g32 or rtn-int4-channel would split\); valid sizes for it: \[1\]"):
        LLM("tiny", load_format="dummy", quantization="rtn-int4", tensor_parallel_size=2, **CONTINUOUS)
    # Llama 2 7B: o_proj 4096 and down_proj 11008 inputs. Over 4 ranks down_proj gives 2752 each,
    # 21.5 groups of 128 but 43 of 64.
    assert valid_tp_sizes(PRESETS["llama2-7b"], QuantSpec.parse("rtn-int4")) == [1, 2]
    assert valid_tp_sizes(PRESETS["llama2-7b"], QuantSpec.parse("rtn-int4-g64")) == [1, 2, 4]


def test_a_rank_part_that_splits_a_packed_word_is_refused():
    narrow = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=4)  # 1 KV head of 4 channels per rank
    with pytest.raises(ValueError, match=r"each rank's 4 output channels of k_proj are not a multiple of 8 "
                                         r"\(INT4 packs 8 codes into an int32\)"):
        check_layout(narrow, 2, QuantSpec.parse("rtn-int4-g16"))
    check_layout(narrow, 2, QuantSpec.parse("rtn-int8"))  # INT8 packs 4 to a word in a checkpoint: fits
    with pytest.raises(ValueError, match=r"input channels \(groups of 32\) \[0, 48\) do not split into whole units"):
        packed_index("scales", (slice(None), slice(0, 48)), 4, 32)
    with pytest.raises(ValueError, match=r"output channels \(8 zero points per int32\) \[4, 12\)"):
        packed_index("qzeros", (slice(4, 12),), 4, 32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="gptq-int4", tensor_parallel_size=2), r"calibrates on the whole model.*save_quantized"),
    (dict(quantization="awq-int4", pipeline_parallel_size=2), r"calibrates on the whole model.*save_quantized"),
    (dict(quantization="fp8", tensor_parallel_size=2), r"fp8.*largest value over all input channels"),
])
def test_methods_that_cannot_split_are_refused_by_the_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(batching="continuous", **kwargs)
