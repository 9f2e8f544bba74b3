"""Key smoothing for the int8 KV cache: the factors, their exactness in float, the error they save,
and the calibration that sets them in PagedAttention (and in the engine, through its runner)."""

from __future__ import annotations

import pytest
import torch

from tests.test_attention import (BLOCK, DIM, HEADS, KV_HEADS, PREFILL_PATHS, dense_attention,
                                  skip_without_kernel)
from tokenmill.model.attention import AttentionMetadata, PagedAttention, prefill_chunk
from tokenmill.model.kv_int8 import SCALE_BYTES, dequantize_rows, quantize_rows
from tokenmill.model.kv_smoothing import key_smoothing_factors
from tokenmill.model.layers import RotaryEmbedding, apply_rotary

GROUP = HEADS // KV_HEADS


def keys_with_a_large_pair(n: int, bias: float = 60.0) -> torch.Tensor:
    """Post-RoPE keys [n, Hkv, D] whose pre-RoPE channel 1 carries a constant, as k_proj's
    bias gives Qwen2's keys, in KV head 0."""
    torch.manual_seed(7)
    k = torch.randn(n, KV_HEADS, DIM)
    k[:, 0, 1] += bias
    cos, sin = RotaryEmbedding(DIM, 37 * n, 10000.0, torch.float32).cos_sin(torch.arange(n) * 37)
    return apply_rotary(k, cos, sin)


def smoothed(q: torch.Tensor, k: torch.Tensor, factors: torch.Tensor):
    return q * factors.repeat_interleave(GROUP, dim=0), k / factors


def test_factors_are_powers_of_two_shared_by_rotary_pairs_and_shrink_the_large_pair():
    factors = key_smoothing_factors(keys_with_a_large_pair(300))
    assert factors.shape == (KV_HEADS, DIM)
    assert torch.equal(factors[..., :DIM // 2], factors[..., DIM // 2:])
    assert torch.equal(torch.exp2(torch.log2(factors).round()), factors) and (factors >= 1).all()
    assert factors[0, 1] >= 16  # a pair of norm ~60 against a median of ~2
    assert factors[1].max() <= 2  # no large pair in head 1: (nearly) left alone


def test_smoothing_commutes_with_rope_and_leaves_float_attention_unchanged():
    k = keys_with_a_large_pair(40)
    factors = key_smoothing_factors(k)
    cos, sin = RotaryEmbedding(DIM, 64, 10000.0, torch.float32).cos_sin(torch.arange(40))
    raw = torch.randn(40, KV_HEADS, DIM)
    torch.testing.assert_close(apply_rotary(raw.clone(), cos, sin) / factors,
                               apply_rotary(raw / factors, cos, sin))
    for dtype in (torch.float32, torch.bfloat16):
        q, keys, v = torch.randn(40, HEADS, DIM).to(dtype), k.to(dtype), torch.randn(
            40, KV_HEADS, DIM).to(dtype)
        q_s, k_s = smoothed(q, keys, factors.to(dtype))
        # Powers of two: every product q_c * k_c is the same number, so the scores are equal.
        assert torch.equal(torch.einsum("qhd,khd->hqk", q_s.float(), k_s.float().repeat_interleave(
            GROUP, 1)), torch.einsum("qhd,khd->hqk", q.float(), keys.float().repeat_interleave(
                GROUP, 1)))
        torch.testing.assert_close(dense_attention(q_s.float(), k_s.float(), v.float(), 0),
                                   dense_attention(q.float(), keys.float(), v.float(), 0))


def test_smoothing_lowers_the_score_error_of_int8_keys():
    k = keys_with_a_large_pair(200)
    q = torch.randn(200, HEADS, DIM)
    factors = key_smoothing_factors(k)

    def score_error(q: torch.Tensor, k: torch.Tensor) -> float:
        exact = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(GROUP, 1))
        read = dequantize_rows(quantize_rows(k), torch.float32).repeat_interleave(GROUP, 1)
        return (torch.einsum("qhd,khd->hqk", q, read) - exact)[:GROUP].pow(2).mean().item()

    # The query heads of KV head 0, whose keys carry the large pair.
    assert score_error(*smoothed(q, k, factors)) < score_error(q, k) / 10


@pytest.mark.parametrize("use_kernel", PREFILL_PATHS)
def test_calibrating_forward_sets_the_factors_and_every_path_reads_smoothed_rows(use_kernel):
    """The first int8 forward after calibrate_key_smoothing takes its factors from its keys and
    caches k / s; it and a later chunk over that cache attend as dense attention over the
    smoothed, round-tripped rows with q * s, and stay closer to float than without smoothing."""
    skip_without_kernel(use_kernel)
    n, tail = 24, 5
    k = keys_with_a_large_pair(n)
    q, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM)
    table = torch.tensor([5, 2, 7, 0, 3, 6])
    slots = torch.tensor([int(table[t // BLOCK]) * BLOCK + t % BLOCK for t in range(n)])

    def run(attn: PagedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = torch.zeros(8, BLOCK, KV_HEADS, DIM + SCALE_BYTES, dtype=torch.int8)
        v_cache = torch.zeros_like(k_cache)
        whole = attn.forward(q, k, v, k_cache, v_cache, AttentionMetadata(
            slots, [prefill_chunk(0, n, n, table, use_kernel, torch.float32, q.device)], n, None,
            None, None))
        last = attn.forward(q[-tail:], k[-tail:], v[-tail:], k_cache, v_cache, AttentionMetadata(
            slots[-tail:], [prefill_chunk(0, tail, n, table, use_kernel, torch.float32, q.device)],
            tail, None, None, None))
        return whole, last

    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    attn.calibrate_key_smoothing()
    whole, last = run(attn)
    factors = key_smoothing_factors(k)
    assert torch.equal(attn.key_smoothing, factors) and not attn.calibrating
    q_s, k_s = smoothed(q, k, factors)
    k_read = dequantize_rows(quantize_rows(k_s), torch.float32)
    v_read = dequantize_rows(quantize_rows(v), torch.float32)
    torch.testing.assert_close(whole, dense_attention(q_s, k_read, v_read, 0),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, whole[-tail:], atol=1e-6, rtol=1e-6)
    exact = dense_attention(q, k, v, 0)
    plain, _ = run(PagedAttention(HEADS, KV_HEADS, DIM))
    assert (whole - exact).norm() < (plain - exact).norm()
