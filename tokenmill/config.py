"""EngineConfig: every engine option in one dataclass, validated once.

Built from `LLM(**kwargs)` or CLI flags (the flag is the field name with dashes); option names
follow vLLM so its users feel at home.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# auto: a GGUF file's own blocks where they give the float model's numbers exactly (gguf), else
# none (quant/gguf.py's auto_quantization says when).
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
# How int4 codes are chosen (docs/quantization.md): round to nearest; GPTQ with act-order and
# static groups; GPTQ over the columns in their own order; gptq or rtn of the products with their
# inputs rotated (tokenmill/quant/rotation.py); and gptq-hadamard with its scales and mins then
# distilled end to end from the float model (tokenmill/quant/distill.py).
QUANT_METHODS = ("rtn", "gptq", "gptq-in-order", "gptq-hadamard", "rtn-hadamard",
                 "gptq-hadamard-distill")
QUANT_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: tokenmill/model/kv_int8.py
SPECULATIVE_METHODS = ("ngram", "draft", "self")


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB for the KV pool
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # Tensor parallelism (docs/scaling.md): ranks split heads and MLP columns; rank 0 schedules.
    tensor_parallel_size: int = 1
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous; None: a local port
    nnodes: int = 1  # hosts the ranks are spread over, tensor_parallel_size / nnodes on each
    node_rank: int = 0  # this host's index; node 0 runs the engine, the others only workers
    debug_checks: bool = False  # assert block accounting after every step
    quantization: str = "auto"  # weights: auto, none, int8 (per channel), int4 (grouped), gguf
    # Inputs per int4 scale and zero point: 32, 64, 128, or auto (quant/gguf.py's
    # auto_group_size: 64 over a file already 4-bit in groups of 32, else 128).
    quant_group_size: int | str = "auto"
    quant_method: str = "gptq-hadamard"  # int4 only: one of QUANT_METHODS
    kv_cache_dtype: str = "auto"  # int8: a scale per token and head, about twice the tokens
    # Speculative decoding (docs/speculative.md); None turns it off.
    speculative_method: str | None = None  # ngram (prompt lookup), draft (a second model), self
    num_speculative_tokens: int = 4  # proposals per request per step, at most
    ngram_max: int = 4  # longest suffix n-gram looked up in the request's own tokens
    ngram_min: int = 1  # shortest one
    speculative_model: str | None = None  # draft: a model with the target's tokenizer
    speculative_quantization: str | None = None  # draft weights; None: int4 for self, else ours
    speculative_draft_layers: int | None = None  # self: only the first N layers draft
    speculative_disable_batch_size: int | None = None  # above this many running, propose none
    speculative_adaptive: bool = True  # propose fewer when measured acceptance makes it a loss

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", *DTYPES), "dtype", self.dtype,
               f"must be one of auto, {', '.join(DTYPES)}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               self.max_num_batched_tokens, "must be >= 1")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", self.block_size,
               "must be a power of two up to 128")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               self.max_model_len, "must be >= 1")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
               self.kv_cache_memory, "must be > 0 GiB")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
               self.num_kv_blocks, "must be >= 1")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size,
               "must be >= 1")
        _check(self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0, "nnodes",
               self.nnodes, f"must divide tensor_parallel_size={self.tensor_parallel_size}")
        _check(0 <= self.node_rank < self.nnodes, "node_rank", self.node_rank,
               f"must be in 0..{self.nnodes - 1}")
        _check(self.nnodes == 1 or self.dist_init_addr is not None, "dist_init_addr",
               self.dist_init_addr, "is required when nnodes > 1 (rank 0's host:port)")
        _check(self.dist_init_addr is None or _is_host_port(self.dist_init_addr),
               "dist_init_addr", self.dist_init_addr, "must be host:port")
        # Quantizing a row-parallel shard scales its own columns only: not the same model.
        _check(self.tensor_parallel_size == 1 or self.quantization in ("auto", "none"),
               "quantization",
               self.quantization, "is not supported with tensor_parallel_size > 1 yet")
        _check(self.quantization in QUANTIZATIONS, "quantization", self.quantization,
               f"must be one of {', '.join(QUANTIZATIONS)}")
        _check(self.quant_group_size in ("auto", *QUANT_GROUP_SIZES), "quant_group_size",
               self.quant_group_size, "must be auto, 32, 64 or 128")
        _check(self.quant_method in QUANT_METHODS, "quant_method", self.quant_method,
               f"must be one of {', '.join(QUANT_METHODS)}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
               f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        method = self.speculative_method
        _check(method is None or method in SPECULATIVE_METHODS, "speculative_method", method,
               f"must be one of {', '.join(SPECULATIVE_METHODS)} (or unset)")
        _check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
               self.num_speculative_tokens, "must be between 1 and 16")
        _check(1 <= self.ngram_min, "ngram_min", self.ngram_min, "must be >= 1")
        _check(self.ngram_min <= self.ngram_max, "ngram_max", self.ngram_max,
               f"must be >= ngram_min={self.ngram_min}")
        _check((self.speculative_model is not None) == (method == "draft"), "speculative_model",
               self.speculative_model, "is required by speculative_method='draft' and used by "
               "nothing else")
        _check(self.speculative_quantization in (None, "none", "int8", "int4"),
               "speculative_quantization", self.speculative_quantization,
               "must be none, int8 or int4")
        _check(self.speculative_draft_layers is None
               or (method == "self" and self.speculative_draft_layers >= 1),
               "speculative_draft_layers", self.speculative_draft_layers,
               "must be >= 1 and needs speculative_method='self'")
        _check(self.speculative_disable_batch_size is None
               or self.speculative_disable_batch_size >= 1, "speculative_disable_batch_size",
               self.speculative_disable_batch_size, "must be >= 1")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.bfloat16 if cpu_has_fast_bf16() or self.device.startswith("cuda") \
            else torch.float32


def cpu_has_fast_bf16() -> bool:
    """AVX-512 BF16 or AMX: the CPU multiplies bf16 natively, so bf16 beats fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid engine option {name}={value!r}: {rule}")
