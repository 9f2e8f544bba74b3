"""Paged attention against a dense reference: the C++ decode kernel, the SDPA fallback, prefill."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.model.attention import (AttentionMetadata, PagedAttention, padding_mask,
                                       prefill_chunk)
from tokenmill.model.kv_int8 import SCALE_BYTES, dequantize_rows, quantize_rows

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def dense_attention(q, k, v, causal_offset):
    """q [Tq, H, D] at positions causal_offset.., k/v [Tk, Hkv, D]; the plain definition."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + causal_offset
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def scattered_cache(seqs, dtype, num_blocks=64, int8=False, block=BLOCK):
    """Write each sequence's K/V into shuffled blocks; return caches and block tables.

    int8: the cache holds kv_int8 rows (codes and a scale) instead of `dtype` values."""
    if int8:
        seqs = [(quantize_rows(k), quantize_rows(v)) for k, v in seqs]
    dim = seqs[0][0].shape[-1]
    k_cache = torch.zeros(num_blocks, block, KV_HEADS, dim, dtype=torch.int8 if int8 else dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for k, v in seqs:
        table = [free.pop() for _ in range(-(-k.shape[0] // block))]
        for t in range(k.shape[0]):
            k_cache[table[t // block], t % block] = k[t]
            v_cache[table[t // block], t % block] = v[t]
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
    out = torch.empty_like(q)
    attn._decode(q, k_cache, v_cache, meta, out)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (k, v) in enumerate(seqs):
        expected = dense_attention(q[i:i + 1].float(), k.float(), v.float(), lens[i] - 1)
        torch.testing.assert_close(out[i:i + 1].float(), expected, atol=tolerance, rtol=tolerance)


PREFILL_PATHS = [pytest.param(True, id="kernel"), pytest.param(False, id="sdpa")]


def skip_without_kernel(use_kernel: bool) -> None:
    if use_kernel and cpu_kernels() is None:
        pytest.skip("no C++ compiler here")


@pytest.mark.parametrize("use_kernel", PREFILL_PATHS)
def test_prefill_with_cached_prefix_matches_dense_reference(use_kernel):
    skip_without_kernel(use_kernel)
    torch.manual_seed(1)
    context, query = 19, 6
    k, v = torch.randn(context, KV_HEADS, DIM), torch.randn(context, KV_HEADS, DIM)
    k_cache, v_cache, [table] = scattered_cache([(k, v)], torch.float32)
    q = torch.randn(query, HEADS, DIM)
    chunk = prefill_chunk(0, query, context, torch.tensor(table), use_kernel, torch.float32,
                          q.device)
    slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK
                          for t in range(context - query, context)])
    meta = AttentionMetadata(slots, [chunk], query, None, None, None)
    out = PagedAttention(HEADS, KV_HEADS, DIM).forward(
        q, k[-query:], v[-query:], k_cache, v_cache, meta)
    torch.testing.assert_close(out, dense_attention(q, k, v, context - query),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", PREFILL_PATHS)
def test_fresh_prefill_is_causal_self_attention(use_kernel):
    skip_without_kernel(use_kernel)
    torch.manual_seed(2)
    n = 9
    q, k, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(
        n, KV_HEADS, DIM)
    k_cache = torch.zeros(8, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    chunk = prefill_chunk(0, n, n, torch.arange(3), use_kernel, torch.float32, q.device)
    meta = AttentionMetadata(torch.arange(n), [chunk], n, None, None, None)
    out = PagedAttention(HEADS, KV_HEADS, DIM).forward(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(out, dense_attention(q, k, v, 0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.flatten(0, 1)[:n], k)  # K/V written into their slots


# ---- the int8 KV cache ------------------------------------------------------------------------

def test_int8_rows_round_trip_within_half_a_step():
    torch.manual_seed(3)
    x = torch.randn(7, KV_HEADS, DIM) * torch.logspace(-3, 2, 7).view(7, 1, 1)
    x[0, 0] = 0.0  # an all-zero row comes back exactly
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, KV_HEADS, DIM + SCALE_BYTES)
    scales = x.abs().amax(dim=-1, keepdim=True) / 127
    restored = dequantize_rows(rows, torch.float32)
    assert ((restored - x).abs() <= scales / 2 * (1 + 1e-6)).all()
    assert torch.equal(restored[0, 0], x[0, 0])
    assert torch.equal(dequantize_rows(torch.zeros(2, DIM + SCALE_BYTES, dtype=torch.int8),
                                       torch.bfloat16), torch.zeros(2, DIM, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cache_write_kernel_quantizes_as_quantize_rows(dtype):
    """write_kv_cache into an int8 cache writes quantize_rows' bytes: the same codes (half-way
    values round to even), the same scale, zeros for an all-zero row."""
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(2)
    k = (torch.randn(9, KV_HEADS, 64) * 3).to(dtype)
    v = (torch.randn(9, KV_HEADS, 64) * 3).to(dtype)
    k[2] = 0.0
    k[3, 0, :2] = torch.tensor([127.0, 0.5])  # scale 1: 0.5 lies half-way, and rounds to 0
    k[4, 1, :3] = torch.tensor([-2.54, 1.27, 0.635])  # on steps of 0.02 and their halves
    caches = [torch.zeros(4, 4, KV_HEADS, 64 + SCALE_BYTES, dtype=torch.int8) for _ in range(2)]
    slots = torch.tensor([5, 0, 15, 7, 3, 9, 1, 12, 2])
    cpu_kernels().write_kv_cache(k, v, caches[0], caches[1], slots)
    for rows, cache in zip((k, v), caches):
        assert torch.equal(cache.view(16, KV_HEADS, -1)[slots], quantize_rows(rows))


def test_int8_cache_prefill_is_the_tiled_prefill_over_its_bf16_values():
    """bfloat16 prefill over an int8 cache: bit for bit the tiled kernel's output over a bfloat16
    cache holding dequantize_rows' values, and near the dense reference."""
    if cpu_kernels() is None or not cpu_kernels().linear_bf16_available():
        pytest.skip("the tiled prefill needs AVX-512 BF16")
    torch.manual_seed(6)
    length, block = 70, 16
    k, v = (torch.randn(length, KV_HEADS, 64).bfloat16() for _ in range(2))
    int8_caches = scattered_cache([(k, v)], torch.bfloat16, 12, int8=True, block=block)
    k_cache, v_cache, [table] = int8_caches
    bf16_caches = [dequantize_rows(c, torch.bfloat16) for c in (k_cache, v_cache)]
    q = torch.randn(30, HEADS, 64).bfloat16()
    positions = torch.arange(length - 30 + 1, length + 1)  # a chunk after a cached prefix
    outs = [torch.empty_like(q) for _ in range(2)]
    for (kc, vc), out in zip(((k_cache, v_cache), bf16_caches), outs):
        cpu_kernels().paged_prefill_attention(q, kc, vc, torch.tensor(table), positions,
                                              64 ** -0.5, out)
    assert torch.equal(outs[0], outs[1])
    k_read, v_read = (c[table].flatten(0, 1)[:length].float() for c in bf16_caches)
    expected = dense_attention(q.float(), k_read, v_read, length - 30)
    torch.testing.assert_close(outs[0].float(), expected, atol=2e-2, rtol=2e-2)


# (head_dim, block): the kernel's row-by-row path, and its 16-row runs (head_dim a multiple of
# 64, blocks of 16), with a sequence long enough to attend in parts.
INT8_SHAPES = [(DIM, BLOCK, [1, 5, 17, 32]), (64, 16, [1, 16, 37, 600])]


def int8_decode_case(dtype, dim=DIM, block=BLOCK, lens=(1, 5, 17, 32)):
    torch.manual_seed(4)
    lens = list(lens)
    seqs = [(torch.randn(n, KV_HEADS, dim).to(dtype), torch.randn(n, KV_HEADS, dim).to(dtype))
            for n in lens]
    num_blocks = sum(-(-n // block) for n in lens) + 4
    k_cache, v_cache, tables = scattered_cache(seqs, dtype, num_blocks, int8=True, block=block)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), HEADS, dim).to(dtype)
    return lens, seqs, k_cache, v_cache, block_tables, q


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,block,lens", INT8_SHAPES)
def test_int8_decode_matches_dense_reference(use_kernel, dtype, dim, block, lens):
    """Against dense attention over the de-quantized K/V (tight: the same numbers) and over the
    original K/V (loose: what int8 costs)."""
    if use_kernel and cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    lens, seqs, k_cache, v_cache, block_tables, q = int8_decode_case(dtype, dim, block, lens)
    seq_lens = torch.tensor(lens)
    mask = None if use_kernel else padding_mask(seq_lens, block_tables.shape[1] * block, dtype)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), [], 0, block_tables, seq_lens, mask)
    out = torch.empty_like(q)
    PagedAttention(HEADS, KV_HEADS, dim)._decode(q, k_cache, v_cache, meta, out)
    out = out.float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (k, v) in enumerate(seqs):
        k_read = dequantize_rows(quantize_rows(k), torch.float32)
        v_read = dequantize_rows(quantize_rows(v), torch.float32)
        expected = dense_attention(q[i:i + 1].float(), k_read, v_read, lens[i] - 1)
        torch.testing.assert_close(out[i:i + 1], expected, atol=tolerance, rtol=tolerance)
        unquantized = dense_attention(q[i:i + 1].float(), k.float(), v.float(), lens[i] - 1)
        torch.testing.assert_close(out[i:i + 1], unquantized, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dim,block,lens", INT8_SHAPES)
def test_int8_decode_kernel_matches_fallback(dim, block, lens):
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    lens, _, k_cache, v_cache, block_tables, q = int8_decode_case(torch.float32, dim, block, lens)
    seq_lens = torch.tensor(lens)
    kernel, fallback = kernel_and_fallback(PagedAttention(HEADS, KV_HEADS, dim), q, k_cache,
                                           v_cache, block_tables, seq_lens, block)
    torch.testing.assert_close(kernel, fallback, atol=1e-6, rtol=1e-6)


def kernel_and_fallback(attn, q, k_cache, v_cache, block_tables, seq_lens, block):
    """The decode outputs of the C++ kernel and of the SDPA fallback, for the same inputs."""
    empty = torch.empty(0, dtype=torch.long)
    kernel, fallback = torch.empty_like(q), torch.empty_like(q)
    attn._decode(q, k_cache, v_cache,
                 AttentionMetadata(empty, [], 0, block_tables, seq_lens, None), kernel)
    mask = padding_mask(seq_lens, block_tables.shape[1] * block, q.dtype)
    attn._decode(q, k_cache, v_cache,
                 AttentionMetadata(empty, [], 0, block_tables, seq_lens, mask), fallback)
    return kernel, fallback


@pytest.mark.parametrize("use_kernel", PREFILL_PATHS)
def test_int8_prefill_attends_to_what_the_cache_holds(use_kernel):
    """A fresh prefill writes int8 rows and attends to their de-quantized values, so a later
    chunk over the cached prefix sees the same K/V: both equal dense attention over them."""
    skip_without_kernel(use_kernel)
    torch.manual_seed(5)
    n, tail = 11, 4
    q, k, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(
        n, KV_HEADS, DIM)
    k_cache = torch.zeros(8, BLOCK, KV_HEADS, DIM + SCALE_BYTES, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    table = torch.tensor([5, 2, 7])
    slots = torch.tensor([int(table[t // BLOCK]) * BLOCK + t % BLOCK for t in range(n)])
    whole = attn.forward(q, k, v, k_cache, v_cache, AttentionMetadata(
        slots, [prefill_chunk(0, n, n, table, use_kernel, torch.float32, q.device)], n, None,
        None, None))
    k_read = dequantize_rows(quantize_rows(k), torch.float32)
    v_read = dequantize_rows(quantize_rows(v), torch.float32)
    torch.testing.assert_close(whole, dense_attention(q, k_read, v_read, 0), atol=1e-5, rtol=1e-5)
    assert torch.equal(dequantize_rows(k_cache[table].flatten(0, 1)[:n], torch.float32), k_read)
    chunk = prefill_chunk(0, tail, n, table, use_kernel, torch.float32, q.device)
    last = attn.forward(q[-tail:], k[-tail:], v[-tail:], k_cache, v_cache, AttentionMetadata(
        slots[-tail:], [chunk], tail, None, None, None))
    torch.testing.assert_close(last, whole[-tail:], atol=1e-6, rtol=1e-6)


# SmolLM2's (its bf16 scores on AMX tiles where the CPU has them), Qwen2.5-0.5B's in blocks of
# 32, and Qwen2.5-1.5B's (8 tiles of queries: more than the tiles hold, so VDPBF16PS).
MODEL_SHAPES = [(9, 3, 64, 16), (14, 2, 64, 32), (12, 2, 128, 16)]


@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_on_model_shapes(dtype, shape):
    """Models' shapes (SmolLM2: 9 query heads on 3 KV heads, head_dim 64, blocks of 16), where
    the kernel takes its 16-rows-at-a-time paths, with sequences ending anywhere in a block, and
    sequences past 512 tokens, which attend in parts that are merged: the kernel equals the SDPA
    fallback."""
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(6)
    heads, kv_heads, dim, block = shape
    lens = [1, 15, 16, 17, 40, 100, 512, 513, 1300]
    k_cache = torch.randn(192, block, kv_heads, dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    blocks = torch.randperm(192).tolist()
    tables = [[blocks.pop() for _ in range(-(-n // block))] for n in lens]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    kernel, fallback = kernel_and_fallback(PagedAttention(heads, kv_heads, dim), q, k_cache,
                                           v_cache, block_tables, seq_lens, block)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), fallback.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_sequence_attends_the_same_alone_or_in_a_batch(dtype):
    """A sequence split into parts (past 512 tokens) is split by its length alone: beside other
    sequences it gives the very numbers it gives alone."""
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(7)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    k_cache = torch.randn(192, block, kv_heads, dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(192)[:180].view(2, 90)
    seq_lens = torch.tensor([1300, 30])
    q = torch.randn(2, heads, dim).to(dtype)
    both, alone = torch.empty_like(q), torch.empty_like(q[:1])
    cpu_kernels().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, both)
    cpu_kernels().paged_decode_attention(q[:1], k_cache, v_cache, block_tables[:1], seq_lens[:1],
                                         0.125, alone)
    assert torch.equal(both[:1], alone)


def dense_attention_gqa(q, k, v, causal_offset):
    """dense_attention for any head counts: q [Tq, H, D], k/v [Tk, Hkv, D], in float32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / q.shape[2] ** 0.5
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + causal_offset
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def bf16_prefill(heads, kv_heads, dim, block, context, queries, seed):
    """A bfloat16 cache of `context` tokens in shuffled blocks and the last `queries` of them as
    a prefill chunk on the kernel path: (q, k, v, k_cache, v_cache, table)."""
    torch.manual_seed(seed)
    blocks = -(-context // block)
    k_cache = torch.randn(2 * blocks + 1, block, kv_heads, dim).bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(2 * blocks + 1)[:blocks]
    k, v = (c[table].flatten(0, 1)[:context] for c in (k_cache, v_cache))
    # q as a view into a fused qkv product, as the model passes it
    q = torch.randn(queries, heads + 2 * kv_heads, dim).bfloat16()[:, :heads]
    return q, k, v, k_cache, v_cache, table


@pytest.mark.parametrize("heads,kv_heads,dim,block", [(9, 3, 64, 16), (14, 2, 64, 4),
                                                      (4, 4, 128, 32), (2, 1, 64, 32)])
@pytest.mark.parametrize("context,queries", [(1, 1), (16, 16), (17, 17), (40, 13), (300, 300)])
def test_tiled_bf16_prefill_matches_dense_reference(heads, kv_heads, dim, block, context,
                                                    queries):
    """bfloat16 prefill with head_dim 64 or 128 runs in tiles of 16 queries (on AMX tiles for 64
    and blocks of 16s, where the CPU has them; probabilities rounded to bfloat16 for V): within
    bfloat16's rounding of the dense result, as the per-token path is, for partial tiles and
    runs, a cached prefix and GQA."""
    skip_without_kernel(True)
    q, k, v, k_cache, v_cache, table = bf16_prefill(heads, kv_heads, dim, block, context,
                                                    queries, seed=7)
    chunk = prefill_chunk(0, queries, context, table, True, torch.bfloat16, q.device)
    tiled = torch.empty(q.shape, dtype=q.dtype)
    cpu_kernels().paged_prefill_attention(q, k_cache, v_cache, table, chunk.seq_lens,
                                          dim ** -0.5, tiled)
    per_token = torch.empty_like(tiled)
    cpu_kernels().paged_decode_attention(q, k_cache, v_cache, table.expand(queries, -1),
                                         chunk.seq_lens, dim ** -0.5, per_token)
    expected = dense_attention_gqa(q, k, v, context - queries)
    for out in (tiled, per_token):
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert (tiled.float() - expected).abs().max() <= 2 * (per_token.float() - expected).abs().max()


def test_tiled_bf16_prefill_does_not_depend_on_chunking():
    """A query token's result depends on its own position and the keys only: the same tokens
    prefilled as one chunk or as chunks after a cached prefix (tiles starting elsewhere, partial
    ones) give the same bits, as chunked prefill and prefix-cache hits need."""
    skip_without_kernel(True)
    heads, kv_heads, dim, context = 9, 3, 64, 100
    q, _, _, k_cache, v_cache, table = bf16_prefill(heads, kv_heads, dim, 16, context, context,
                                                    seed=8)

    def attend(start, end):
        out = torch.empty(end - start, heads, dim, dtype=torch.bfloat16)
        cpu_kernels().paged_prefill_attention(q[start:end], k_cache, v_cache, table,
                                              torch.arange(start + 1, end + 1), dim ** -0.5, out)
        return out

    whole = attend(0, context)
    chunked = torch.cat([attend(0, 37), attend(37, 41), attend(41, context)])
    assert torch.equal(whole, chunked)
