"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples.

It owns the device side: the model weights and the KV pool tensors (one K and one V tensor per
layer, [num_blocks, block_size, num_kv_heads, row]: a row is head_dim values, or the int8
codes and scale of tokenmill/model/kv_int8.py); under tensor parallelism, this rank's
shard of both, and on rank 0 the worker processes that hold the rest. It reads requests but
never changes them; the engine applies the sampled tokens and the prompt logprobs. A chunk
carrying speculative tokens gets logits at each of them and the rejection sampler decides which
survive.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.shard import TensorShard
from tokenmill.distributed.worker_group import WorkerGroup
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenmill.model.attention import (AttentionMetadata, cache_slot, decode_kernel_available,
                                       padding_mask, prefill_chunk)
from tokenmill.model.decode_layers import DecodePlan
from tokenmill.model.kv_int8 import cache_row
from tokenmill.model.kv_smoothing import CALIBRATION_TEXT
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import LoadedModel
from tokenmill.model.sampler import Sampler, logprob_entries
from tokenmill.quant import model_bytes, quantize_model
from tokenmill.quant.gguf import auto_group_size, auto_quantization
from tokenmill.spec.rejection import RejectionSampler

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_GIB = 2.0
# Prompt logprobs are computed this many positions at a time, so a long prompt never holds a
# [prompt_len, vocab] logits tensor (2048 x 49152 fp32 would be 400 MB).
PROMPT_LOGPROB_ROWS = 256


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # flat rows whose next token is sampled (1 + K per chunk)
    sampled_chunks: list[ScheduledChunk]
    prompt_logprob_chunks: list[tuple[ScheduledChunk, int]]  # (chunk, its first flat row)


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens `first_position`, `first_position + 1`, ... of one request."""
    request: Request
    first_position: int
    entries: list[dict[int, float]]


@dataclass(slots=True)
class StepResult:
    sampled_chunks: list[ScheduledChunk]
    # Per sampled chunk: the accepted speculative tokens, then one token of the target's own.
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float] | None]]
    prompt_logprobs: list[PromptLogprobs]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 shard: TensorShard | None = None) -> None:
        """`shard`: a tensor-parallel worker's rank; rank 0 (the default) starts the others."""
        shard = shard or TensorShard(0, config.tensor_parallel_size)
        shard.check(loaded.config)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype()
        self.block_size = config.block_size
        self.model = LlamaForCausalLM(loaded.config, loaded.weights, self.dtype, self.device,
                                      shard)
        self.float_model_bytes = model_bytes(self.model)
        self.quantization = config.quantization if config.quantization != "auto" \
            else auto_quantization(loaded.path, self.dtype, self.device,
                                   config.tensor_parallel_size)
        group_size = config.quant_group_size if config.quant_group_size != "auto" \
            else auto_group_size(loaded.path)
        quantize_model(self.model, self.quantization, group_size, loaded, config.quant_method)
        # What int4 ran with (eval reports it); None for every other format.
        self.quant_group_size = group_size if self.quantization == "int4" else None
        self.model_bytes = model_bytes(self.model)
        self.sampler = Sampler(config.seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        mc = shard.local_config(loaded.config)  # this rank's KV heads
        row_width, cache_dtype = cache_row(mc.head_dim, self.dtype, config.kv_cache_dtype)
        bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * row_width * cache_dtype.itemsize
        if config.num_kv_blocks is not None:
            self.num_blocks = config.num_kv_blocks
        else:
            gib = config.kv_cache_memory or DEFAULT_KV_CACHE_GIB
            self.num_blocks = max(1, int(gib * 2**30) // (bytes_per_token * self.block_size))
        shape = (self.num_blocks, self.block_size, mc.num_kv_heads, row_width)
        # Zeros, not empty: padded decode slots are masked, but 0 * NaN would still be NaN.
        self.kv_caches = [(torch.zeros(shape, dtype=cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=cache_dtype, device=self.device))
                          for _ in range(mc.num_layers)]
        self.kv_cache_bytes = 2 * mc.num_layers * self.kv_caches[0][0].nbytes
        logger.info("weights: %.1f MiB in %s, %.1f MiB with quantization=%s%s; KV cache: %.1f "
                    "MiB in %s for %d tokens", self.float_model_bytes / 2**20, str(self.dtype)[6:],
                    self.model_bytes / 2**20, self.quantization + (
                        f" (groups of {group_size})" if self.quant_group_size else ""),
                    " (auto)" if config.quantization == "auto" else "", self.kv_cache_bytes / 2**20,
                    str(cache_dtype)[6:], self.kv_capacity_tokens)
        self.use_decode_kernel = decode_kernel_available(self.device)
        if config.kv_cache_dtype == "int8":  # every rank: its first step calibrates its heads
            for layer in self.model.layers:
                layer.self_attn.attn.calibrate_key_smoothing()
        # Last, so nothing after it can fail and leave the other ranks waiting.
        self.workers = WorkerGroup.start(config) if shard.rank == 0 and shard.world_size > 1 \
            else None
        if config.kv_cache_dtype == "int8" and shard.rank == 0:
            # A tokenizer may know more ids than the model embeds (the tests' tiny models).
            self._calibration_prefill([t for t in loaded.tokenizer.encode(CALIBRATION_TEXT)
                                       if t < loaded.config.vocab_size])
        # After the calibration: an int8 cache's plan takes the smoothing factors it sets.
        self.model.decode_plan = DecodePlan.build(self.model, self.kv_caches)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def execute(self, scheduled: SchedulerOutput) -> StepResult:
        inputs = self.prepare(scheduled.chunks)
        with self._all_ranks(inputs):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        prompt_logprobs = [self._prompt_logprobs(hidden, chunk, row)
                           for chunk, row in inputs.prompt_logprob_chunks]
        if not inputs.sampled_chunks:
            return StepResult([], [], [], prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        chunks = inputs.sampled_chunks
        if any(c.num_spec_tokens for c in chunks):
            token_ids, logprobs = self.rejection_sampler(logits, chunks)
            return StepResult(chunks, token_ids, logprobs, prompt_logprobs)
        requests = [c.request for c in chunks]
        sampled = self.sampler(logits, [r.sampling_params for r in requests],
                               [r.generator for r in requests])
        return StepResult(chunks, [[t] for t in sampled.token_ids],
                          [[entry] for entry in sampled.logprobs], prompt_logprobs)

    def _calibration_prefill(self, token_ids: list[int]) -> None:
        """One prefill into the still unused cache's first blocks (what it leaves there is
        never read: a slot is written before it is attended to), on every rank."""
        n = min(len(token_ids), self.kv_capacity_tokens)
        positions = torch.arange(n, device=self.device)
        chunk = prefill_chunk(0, n, n, self._tensor(list(range(-(-n // self.block_size)))),
                              self.use_decode_kernel, self.dtype, self.device)
        meta = AttentionMetadata(positions, [chunk], n, None, None, None)
        inputs = StepInputs(self._tensor(token_ids[:n]), positions, meta, self._tensor([]), [], [])
        with self._all_ranks(inputs):
            self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    def _all_ranks(self, inputs: StepInputs) -> contextlib.AbstractContextManager:
        """Under tensor parallelism the other ranks run the same forward on the same inputs;
        logits and sampling stay here, on rank 0."""
        if self.workers is None:
            return contextlib.nullcontext()
        return self.workers.step(inputs.input_ids, inputs.positions, inputs.meta)

    @property
    def healthy(self) -> bool:
        """False once tensor-parallel workers stopped after an error: no step can run."""
        return self.workers is None or not self.workers.stopped

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if self.workers is not None:
            self.workers.shutdown()

    def _prompt_logprobs(self, hidden: torch.Tensor, chunk: ScheduledChunk,
                         first_row: int) -> PromptLogprobs:
        """The chunk's row for position p scores prompt token p + 1."""
        request = chunk.request
        start = request.num_computed_tokens
        count = min(start + chunk.num_new_tokens, request.num_prompt_tokens - 1) - start
        targets = request.prompt_token_ids[start + 1:start + 1 + count]
        num_top = request.sampling_params.prompt_logprobs or 0
        entries: list[dict[int, float]] = []
        for offset in range(0, count, PROMPT_LOGPROB_ROWS):
            rows = hidden[first_row + offset:first_row + min(count, offset + PROMPT_LOGPROB_ROWS)]
            row_targets = targets[offset:offset + len(rows)]
            entries += logprob_entries(self.model.compute_logits(rows), row_targets,
                                       [num_top] * len(rows))
        return PromptLogprobs(request, start + 1, entries)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        is_decode = [c.num_new_tokens == 1 and c.request.num_computed_tokens > 0 for c in chunks]
        ordered = [c for c, d in zip(chunks, is_decode) if not d] + \
                  [c for c, d in zip(chunks, is_decode) if d]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledChunk] = []
        prompt_logprob_chunks: list[tuple[ScheduledChunk, int]] = []
        prefills = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        num_prefill_tokens = 0
        for chunk in ordered:
            request, start = chunk.request, chunk.request.num_computed_tokens
            end = start + chunk.num_new_tokens
            query_start = len(input_ids)
            tokens = request.token_ids_between(start, end - chunk.num_spec_tokens) \
                + request.spec_token_ids[:chunk.num_spec_tokens]
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(cache_slot(blocks, p, bs) for p in range(start, end))
            if chunk.completes_sequence:  # the last known token, then each speculative one
                logits_indices.extend(range(len(input_ids) - 1 - chunk.num_spec_tokens,
                                            len(input_ids)))
                sampled.append(chunk)
            if request.sampling_params.prompt_logprobs is not None \
                    and start < request.num_prompt_tokens - 1:
                prompt_logprob_chunks.append((chunk, query_start))
            num_blocks = -(-end // bs)
            if chunk.num_new_tokens == 1 and start > 0:
                decode_tables.append(blocks[:num_blocks])
                decode_lens.append(end)
            else:
                prefills.append(prefill_chunk(query_start, chunk.num_new_tokens, end,
                                              self._tensor(blocks[:num_blocks]),
                                              self.use_decode_kernel, self.dtype, self.device))
                num_prefill_tokens += chunk.num_new_tokens
        decode_block_tables = decode_seq_lens = decode_mask = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in decode_tables])
            decode_seq_lens = self._tensor(decode_lens)
            if not self.use_decode_kernel:
                decode_mask = padding_mask(decode_seq_lens, width * bs, self.dtype)
        meta = AttentionMetadata(self._tensor(slots), prefills, num_prefill_tokens,
                                 decode_block_tables, decode_seq_lens, decode_mask)
        return StepInputs(self._tensor(input_ids), self._tensor(positions), meta,
                          self._tensor(logits_indices), sampled, prompt_logprob_chunks)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
