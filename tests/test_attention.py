"""Paged attention against a dense reference: the C++ decode kernel, the SDPA fallback, prefill."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.model.attention import (AttentionMetadata, PagedAttention, PrefillChunk,
                                       causal_mask_with_prefix, padding_mask)

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def dense_attention(q, k, v, causal_offset):
    """q [Tq, H, D] at positions causal_offset.., k/v [Tk, Hkv, D]; the plain definition."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM ** 0.5
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + causal_offset
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def scattered_cache(seqs, dtype, num_blocks=64):
    """Write each sequence's K/V into shuffled blocks; return caches and block tables."""
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for k, v in seqs:
        table = [free.pop() for _ in range(-(-k.shape[0] // BLOCK))]
        for t in range(k.shape[0]):
            k_cache[table[t // BLOCK], t % BLOCK] = k[t]
            v_cache[table[t // BLOCK], t % BLOCK] = v[t]
        tables.append(table)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_dense_reference(use_kernel, dtype):
    if use_kernel and cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(0)
    lens = [1, 5, 17, 32]
    seqs = [(torch.randn(n, KV_HEADS, DIM).to(dtype), torch.randn(n, KV_HEADS, DIM).to(dtype))
            for n in lens]
    k_cache, v_cache, tables = scattered_cache(seqs, dtype)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    mask = None if use_kernel else padding_mask(seq_lens, width * BLOCK, dtype)
    q = torch.randn(len(lens), HEADS, DIM).to(dtype)
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), [], 0, block_tables, seq_lens, mask)
    out = attn._decode(q, k_cache, v_cache, meta)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (k, v) in enumerate(seqs):
        expected = dense_attention(q[i:i + 1].float(), k.float(), v.float(), lens[i] - 1)
        torch.testing.assert_close(out[i:i + 1].float(), expected, atol=tolerance, rtol=tolerance)


def test_prefill_with_cached_prefix_matches_dense_reference():
    torch.manual_seed(1)
    context, query = 19, 6
    k, v = torch.randn(context, KV_HEADS, DIM), torch.randn(context, KV_HEADS, DIM)
    k_cache, v_cache, [table] = scattered_cache([(k, v)], torch.float32)
    q = torch.randn(query, HEADS, DIM)
    chunk = PrefillChunk(0, query, context, torch.tensor(table),
                         causal_mask_with_prefix(query, context, torch.float32, q.device))
    slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK
                          for t in range(context - query, context)])
    meta = AttentionMetadata(slots, [chunk], query, None, None, None)
    out = PagedAttention(HEADS, KV_HEADS, DIM).forward(
        q, k[-query:], v[-query:], k_cache, v_cache, meta)
    torch.testing.assert_close(out, dense_attention(q, k, v, context - query),
                               atol=1e-5, rtol=1e-5)


def test_fresh_prefill_is_causal_self_attention():
    torch.manual_seed(2)
    n = 9
    q, k, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(
        n, KV_HEADS, DIM)
    k_cache = torch.zeros(8, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    meta = AttentionMetadata(torch.arange(n), [PrefillChunk(0, n, n, torch.arange(3), None)], n,
                             None, None, None)
    out = PagedAttention(HEADS, KV_HEADS, DIM).forward(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(out, dense_attention(q, k, v, 0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.flatten(0, 1)[:n], k)  # K/V written into their slots
