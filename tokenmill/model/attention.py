"""Paged attention: write each step's K/V into cache slots, then attend over block tables.

One step's tokens are laid out flat: the prefill chunks first (one per sequence, any length), then
the decode tokens (one per sequence). With the C++ kernel, a prefill chunk's tokens are attended
like decode tokens, each over the cache up to its own position; without it, SDPA does it.
`AttentionMetadata` is built once per step by the model runner and shared by every layer. This
module never allocates or frees blocks; it only reads and writes the slots it is given. A GPU
backend replaces `PagedAttention.forward` and nothing else. An int8 cache (kv_int8.py) is written
quantized and read de-quantized, by every path alike, after key smoothing (kv_smoothing.py) has
moved K's few large channels into q: every path sees the smoothed q and k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_kernels, fused_kernels
from tokenmill.model.kv_int8 import dequantize_rows, quantize_rows
from tokenmill.model.kv_smoothing import key_smoothing_factors


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the step's flat token list
    query_len: int
    context_len: int  # tokens the chunk attends to: cached prefix plus the chunk itself
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids
    # Kernel path: [query_len] keys each query token attends to (its position + 1); the chunk
    # runs through the decode kernel, one query token as one sequence. None on the SDPA path.
    seq_lens: torch.Tensor | None
    mask: torch.Tensor | None  # SDPA path: additive causal mask after a cached prefix, else None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every token in the step
    prefills: list[PrefillChunk]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] block ids, padded with 0
    decode_seq_lens: torch.Tensor | None  # [B] tokens each decode sequence attends to
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size], fallback path only

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_block_tables is None else self.decode_block_tables.shape[0]


def cache_slot(block_ids: list[int], position: int, block_size: int) -> int:
    """The flat cache slot (a row of the pool's [blocks * block_size] tokens) holding the K/V of
    the token at `position` of a sequence whose blocks are `block_ids`."""
    return block_ids[position // block_size] * block_size + position % block_size


def causal_mask_with_prefix(query_len: int, context_len: int, dtype: torch.dtype,
                            device: torch.device) -> torch.Tensor:
    """Query i sits at position context_len - query_len + i and sees keys up to that position."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    mask = torch.zeros(query_len, context_len, dtype=dtype, device=device)
    return mask.masked_fill_(k_pos > q_pos, float("-inf"))


def prefill_chunk(query_start: int, query_len: int, context_len: int, block_table: torch.Tensor,
                  use_kernel: bool, dtype: torch.dtype, device: torch.device) -> PrefillChunk:
    """A chunk for the kernel path when `use_kernel`, else for SDPA (masked after a prefix)."""
    if use_kernel:
        seq_lens = torch.arange(context_len - query_len + 1, context_len + 1, device=device)
        return PrefillChunk(query_start, query_len, context_len, block_table, seq_lens, None)
    mask = None if query_len == context_len else causal_mask_with_prefix(
        query_len, context_len, dtype, device)
    return PrefillChunk(query_start, query_len, context_len, block_table, None, mask)


def padding_mask(seq_lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    k_pos = torch.arange(max_len, device=seq_lens.device).unsqueeze(0)
    mask = torch.zeros(seq_lens.shape[0], max_len, dtype=dtype, device=seq_lens.device)
    return mask.masked_fill_(k_pos >= seq_lens.unsqueeze(1), float("-inf"))[:, None, None, :]


def decode_kernel_available(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_kernels() is not None


class PagedAttention:
    """The caches and the metadata come in with every call; the one state is the key smoothing
    factors of an int8 cache, taken from the first forward after `calibrate_key_smoothing`.

    Decode runs the C++ kernel that reads the block tables in place when it is available;
    otherwise it gathers each sequence's blocks and calls SDPA with a padding mask.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self.calibrating = False
        self.key_smoothing: torch.Tensor | None = None  # [Hkv, D]: cache k / s
        self.query_smoothing: torch.Tensor | None = None  # [H, D]: attend with q * s

    def calibrate_key_smoothing(self) -> None:
        """The next forward with an int8 cache sets the smoothing factors from its keys (and
        uses them); the model runner makes that forward the calibration prefill."""
        self.calibrating = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, row], where a
        row is D values in the model's dtype, or D int8 codes and a scale (kv_int8.py)."""
        int8_cache = k_cache.dtype == torch.int8
        if int8_cache:
            if self.calibrating:
                factors = key_smoothing_factors(k).to(k.dtype)
                self.key_smoothing = factors
                self.query_smoothing = factors.repeat_interleave(self.group, dim=0)
                self.calibrating = False
            if self.key_smoothing is not None:  # powers of two: exact, q.k unchanged
                q, k = q * self.query_smoothing, k / self.key_smoothing
        # The step's int8 rows, K's then V's, where they are made here (one pass for both).
        int8_rows = None
        kernels = fused_kernels(q)
        if kernels is not None:  # quantizes the rows for an int8 cache, as quantize_rows does
            kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            if int8_cache:
                int8_rows = quantize_rows(torch.stack((k, v)))
            cached_k, cached_v = (k, v) if int8_rows is None else int8_rows.unbind()
            k_cache.view(-1, *cached_k.shape[1:]).index_copy_(0, meta.slot_mapping, cached_k)
            v_cache.view(-1, *cached_v.shape[1:]).index_copy_(0, meta.slot_mapping, cached_v)
        if int8_cache and any(chunk.seq_lens is None for chunk in meta.prefills):
            # SDPA prefill attends to this step's K/V directly; give it what the cache holds,
            # so that a later step (a prefix-cache hit, a recompute after preemption) reads
            # these tokens back as exactly these values.
            if int8_rows is None:
                int8_rows = quantize_rows(torch.stack((k, v)))
            k, v = dequantize_rows(int8_rows, q.dtype).unbind()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.seq_lens is not None:
                # torch's CPU SDPA ran causal prefill at about 14 GFLOP/s (85 ms a layer for 1,000
                # tokens in bf16); the kernel reads the block table in place, in bf16 in tiles of
                # 16 queries, else each token as decode does (benchmarks/bench_attention.py).
                cpu_kernels().paged_prefill_attention(q[rows], k_cache, v_cache, chunk.block_table,
                                                      chunk.seq_lens, self.scale, out[rows])
                continue
            if chunk.mask is None:  # nothing cached before this chunk: attend to itself only
                keys, values = k[rows], v[rows]
            else:
                keys = _read(k_cache[chunk.block_table], q.dtype).flatten(0, 1)[:chunk.context_len]
                values = _read(v_cache[chunk.block_table], q.dtype).flatten(0, 1)[
                    :chunk.context_len]
            out[rows] = self._prefill(q[rows], keys, values, chunk.mask)
        if meta.num_decodes:
            decodes = slice(meta.num_prefill_tokens, None)
            self._decode(q[decodes], k_cache, v_cache, meta, out[decodes])
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=self.group > 1)
        return out.transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Writes the decode tokens' attention into `out` [B, H, D], contiguous."""
        if meta.decode_mask is None:  # the C++ kernel reads the block tables in place
            cpu_kernels().paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                 meta.decode_seq_lens, self.scale, out)
            return
        # Each KV head serves `group` query heads; treating those as the query length of one
        # head lets a single SDPA call cover the whole batch without repeating K/V.
        batch = q.shape[0]
        tables = meta.decode_block_tables
        keys = _read(k_cache[tables], q.dtype).flatten(1, 2).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        values = _read(v_cache[tables], q.dtype).flatten(1, 2).permute(0, 2, 1, 3)
        queries = q.view(batch, self.num_kv_heads, self.group, self.head_dim)
        result = F.scaled_dot_product_attention(queries, keys, values,
                                                attn_mask=meta.decode_mask, scale=self.scale)
        out.copy_(result.reshape(batch, self.num_heads, self.head_dim))


def _read(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache blocks as values: int8 rows de-quantized, float ones as they are."""
    return dequantize_rows(cached, dtype) if cached.dtype == torch.int8 else cached
