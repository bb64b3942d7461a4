"""The shape of a Llama-family model, read from a Hugging Face ``config.json``.

One small dataclass instead of transformers' per-architecture config classes: every model minillm
runs (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) is the same decoder with a few switches, and this
file is where those switches are named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.validation import InvalidArgument, check_bool, check_float, check_int

# model_type in config.json -> the switches that architecture turns on.
SUPPORTED_ARCHITECTURES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # Mistral v0.1; we only run lengths inside the window
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self):
        # config.json is input too: a string hidden_size would otherwise fail deep inside torch.empty.
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            check_int(name, getattr(self, name), minimum=1, valid="a positive integer")
        check_float("rms_norm_eps", self.rms_norm_eps, above=0.0, valid="a number > 0")
        check_float("rope_theta", self.rope_theta, above=0.0, valid="a number > 0")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument("num_kv_heads", f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                                                  f"({self.num_kv_heads}): each KV head serves a whole group")
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            check_bool(name, getattr(self, name))
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, minimum=1, valid="None or a positive integer")
        for token in self.eos_token_ids:
            check_int("eos_token_id", token, minimum=0, valid="a token id (an integer >= 0) or a list of them")
        if self.bos_token_id is not None:
            check_int("bos_token_id", self.bos_token_id, minimum=0, valid="None or a token id (an integer >= 0)")

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        per_layer = attn + 3 * h * i + norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed ``config.json`` (transformers 4.x or 5.x field names)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; minillm runs "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only 'silu' is")
        # transformers 5 moves rope_theta/rope_scaling into one rope_parameters dict.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
            elif scaling["rope_type"] != "llama3":
                raise ValueError(
                    f"rope_type {scaling['rope_type']!r} is not supported; valid: 'default', 'llama3'"
                )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            check_int(key, cfg[key], minimum=1, valid="a positive integer")  # by config.json's names
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if not isinstance(eos, (list, tuple)) else list(eos))
        extra = SUPPORTED_ARCHITECTURES[model_type]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=check_float("rope_theta", theta, above=0.0, valid="a number > 0"),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=extra.get("attention_bias", cfg.get("attention_bias", False)),
            qk_norm=extra.get("qk_norm", False),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


# Shapes of well-known checkpoints for load_format="dummy" (random weights, no download):
# how vLLM benchmarks big models without fetching them. Numbers from each model's config.json.
PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, eos_token_ids=[2], bos_token_id=1,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, eos_token_ids=[128001, 128009], bos_token_id=128000,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True, model_type="qwen3",
        eos_token_ids=[151645], bos_token_id=None,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=[2], bos_token_id=1,
    ),
    # A model small enough for property tests that run hundreds of generations on a CPU.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=[1],
        bos_token_id=0,
    ),
}


def hf_config_for(config: ModelConfig):
    """A transformers config object describing the same model as ``config``."""
    from transformers import AutoConfig

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
    kwargs = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
        bos_token_id=config.bos_token_id,
    )
    if config.model_type == "llama":
        kwargs["attention_bias"] = config.attention_bias
    return AutoConfig.for_model(config.model_type, **kwargs)
