"""Configuration names of `tokenmill eval --configs`: each becomes EngineConfig overrides.

A name is parts joined by "+": a weight format (none, int8, int4, int4-g32, int4-g64, int4-g128,
gguf), a quant method for int4 (rtn, gptq, gptq-in-order, gptq-hadamard, rtn-hadamard,
gptq-hadamard-distill), kv-int8 for the int8 KV cache, and bf16 or fp32 for the compute dtype.
Parts not given keep the base options (the command's engine flags), so "int8+kv-int8" is int8
weights and an int8 KV cache in the base dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.config import QUANT_METHODS, QUANTIZATIONS, EngineConfig

DTYPE_PARTS = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True, slots=True)
class EvalConfig:
    name: str
    overrides: dict[str, object]

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        return dataclasses.replace(base, **self.overrides)


def parse_config(name: str) -> EvalConfig:
    overrides: dict[str, object] = {}
    for part in name.split("+"):
        if part in QUANTIZATIONS:
            overrides["quantization"] = part
        elif part.startswith("int4-g") and part[6:] in ("32", "64", "128"):
            overrides.update(quantization="int4", quant_group_size=int(part[6:]))
        elif part in QUANT_METHODS:
            overrides["quant_method"] = part
        elif part == "kv-int8":
            overrides["kv_cache_dtype"] = "int8"
        elif part in DTYPE_PARTS:
            overrides["dtype"] = DTYPE_PARTS[part]
        else:
            raise ValueError(
                f"invalid eval configuration {name!r}: unknown part {part!r}; use parts of "
                f"{', '.join(QUANTIZATIONS)}, int4-g32/64/128, {', '.join(QUANT_METHODS)}, kv-int8, "
                "bf16, fp32 joined by '+'")
    return EvalConfig(name, overrides)


def parse_configs(names: str) -> list[EvalConfig]:
    """A comma-separated list of names, e.g. "int8,int4,kv-int8"."""
    configs = [parse_config(name.strip()) for name in names.split(",") if name.strip()]
    if not configs:
        raise ValueError("invalid eval option configs='': name at least one configuration")
    return configs
