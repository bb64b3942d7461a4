"""What a ``quantization=`` name means: one small frozen dataclass, parsed from the name.

A name is ``<method>-<format>[-g<group size>|-channel][-sym][-noact][-head|-head8]``:

- ``rtn-int4``, ``rtn-int8``: round-to-nearest, no calibration;
- ``gptq-int4``: GPTQ (Frantar et al. 2022) with act-order, from calibration activations;
- ``awq-int4``: AWQ (Lin et al. 2023): activation-aware scales and clipping, then round-to-nearest;
- ``fp8``: FP8 E4M3 weights (one scale per output channel) and activations (one scale per token,
  computed at run time).

INT4 defaults to groups of 128 input channels with an asymmetric grid (a zero point per group), the
ecosystem's common choice; ``-g64`` (any multiple of 8) or ``-channel`` (one group per output channel)
change the grouping, ``-sym`` takes a symmetric grid (zero point fixed at 8), ``-noact`` switches
GPTQ's act-order off. INT8 is symmetric per output channel only: the layout the W8A16 kernel reads.

``-head`` quantizes the LM head too, which every method otherwise keeps dense (as GPTQ and AWQ checkpoints usually
do): by round-to-nearest on the method's grid (FP8: FP8), since calibrating it would need the final norm's
activations. At batch 1 the head is a large share of what a token reads: Llama-2-7B's, in bf16, is 262 MB of an
INT4 model's ~3.9 GB, 60 us of its 1.57 ms a token on an H200. What it costs in perplexity is measured
(``figures/cpu/perplexity_head.json``); a tensor-parallel engine (vocabulary-parallel head) refuses it. ``-head8``
(INT4 methods) quantizes the head to INT8 instead (RTN, per output channel), as llama.cpp's Q4_K_M keeps its
output matrix at 6 bits: half the head's bytes for a fraction of INT4's perplexity cost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

METHODS = ("rtn-int4", "rtn-int8", "gptq-int4", "awq-int4", "fp8")
VALID = ("rtn-int4, rtn-int8, gptq-int4, awq-int4, fp8; INT4 ones may add -g<N> (N a multiple of 8) or "
         "-channel, and -sym; gptq-int4 may add -noact; any may add -head, INT4 ones -head8 instead (e.g. "
         "gptq-int4-g64, awq-int4-channel-sym, rtn-int4-head, rtn-int4-head8)")
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "rtn" | "gptq" | "awq" | "fp8"
    bits: int  # 4 or 8
    group_size: int = -1  # input channels sharing a scale (and zero point); -1: one group per output channel
    sym: bool = True  # symmetric grid (zero point in the middle) or asymmetric (min/max, zero point per group)
    act_order: bool = False  # GPTQ: quantize input channels in order of decreasing Hessian diagonal
    lm_head: bool = False  # the LM head too (by round-to-nearest, or FP8), not only the decoder layers' linears
    head_int8: bool = False  # (with lm_head, INT4 methods) the head in INT8 rather than on the layers' grid

    def __post_init__(self):
        if self.head_int8 and not (self.lm_head and self.bits == 4 and self.method != "fp8"):
            raise ValueError(f"head_int8 (-head8) puts the LM head of an INT4 method in INT8: it needs lm_head=True "
                             f"and an INT4 method, not {self.method} at {self.bits} bits with lm_head={self.lm_head}")

    def head_spec(self) -> "QuantSpec":
        """What ``-head`` / ``-head8`` quantize the LM head with: round-to-nearest on this spec's grid (FP8: FP8),
        since calibrating the head would need the final norm's activations; ``-head8``: RTN INT8 per channel."""
        if self.method == "fp8":
            return self
        return QuantSpec("rtn", 8) if self.head_int8 else replace(self, method="rtn", act_order=False)

    @property
    def name(self) -> str:
        """The canonical name; ``QuantSpec.parse(spec.name) == spec``."""
        if self.method == "fp8":
            return "fp8" + ("-head" if self.lm_head else "")
        name = f"{self.method}-int{self.bits}"
        if self.bits == 4:
            name += "-channel" if self.group_size == -1 else f"-g{self.group_size}" if \
                self.group_size != DEFAULT_GROUP_SIZE else ""
            name += "-sym" if self.sym else ""
            name += "-noact" if self.method == "gptq" and not self.act_order else ""
        return name + ("-head8" if self.head_int8 else "-head" if self.lm_head else "")

    @classmethod
    def parse(cls, name: "str | QuantSpec") -> "QuantSpec":
        if isinstance(name, QuantSpec):
            return name
        base, *options = _split(str(name))
        if base not in METHODS:
            raise ValueError(f"quantization {name!r} is not supported; valid: {VALID}")
        method, fmt = (base, "fp8") if base == "fp8" else base.split("-")
        if method == "fp8":
            spec = cls("fp8", 8)
        elif fmt == "int8":
            spec = cls(method, 8)
        else:
            spec = cls(method, 4, DEFAULT_GROUP_SIZE, sym=False, act_order=method == "gptq")
        for option in options:
            spec = _apply(spec, option, name)
        return spec


def _split(name: str) -> list[str]:
    """"gptq-int4-g64-sym" -> ["gptq-int4", "g64", "sym"] ("fp8" has no format part)."""
    parts = name.split("-")
    if parts[0] == "fp8":
        return parts
    return ["-".join(parts[:2]), *parts[2:]]


def _apply(spec: QuantSpec, option: str, name: str) -> QuantSpec:
    if option == "head" and not spec.lm_head:
        return replace(spec, lm_head=True)
    if option == "head8" and spec.bits == 4 and not spec.lm_head:
        return replace(spec, lm_head=True, head_int8=True)
    if spec.bits == 4 and option == "channel":
        return replace(spec, group_size=-1)
    if spec.bits == 4 and option.startswith("g") and option[1:].isdigit() and int(option[1:]) % 8 == 0 \
            and int(option[1:]) > 0:
        return replace(spec, group_size=int(option[1:]))
    if spec.bits == 4 and option == "sym":
        return replace(spec, sym=True)
    if spec.method == "gptq" and option == "noact":
        return replace(spec, act_order=False)
    raise ValueError(f"quantization {name!r}: option {option!r} is not understood; valid: {VALID}")
