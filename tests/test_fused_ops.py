"""The C++ fused layer steps against the PyTorch code they replace, in float32 and bfloat16."""

import pytest
import torch

from tokenmill.kernels import cpu_has_amx, cpu_kernels
from tokenmill.model import layers
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler here")
DTYPES = [torch.float32, torch.bfloat16]


def reference(fn):
    """fn() run through the plain PyTorch path."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "fused_kernels", lambda x: None)
        return fn()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_rms_norm_matches_pytorch(dtype, tokens):
    torch.manual_seed(tokens)
    norm = RMSNorm((1 + torch.randn(576) / 4).to(dtype), 1e-5)
    x = (torch.randn(tokens, 576) * 3).to(dtype)
    expected = reference(lambda: norm(x))
    # Only the order of the sum of squares differs: a float32 ulp of the scale, which in
    # bfloat16 can move a value across a rounding boundary (one bfloat16 ulp, 2^-8 relative).
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(norm(x), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_and_norm_match_pytorch(dtype):
    torch.manual_seed(1)
    norm = RMSNorm((1 + torch.randn(64) / 4).to(dtype), 1e-6)
    x, residual = torch.randn(9, 64).to(dtype), torch.randn(9, 64).to(dtype)
    expected_residual = residual + x  # one rounding, as the eager add
    expected, ref_residual = reference(lambda: norm(x, residual.clone()))
    out, new_residual = norm(x, residual)
    assert new_residual is residual  # updated in place
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(ref_residual, expected_residual, atol=0, rtol=0)
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_is_bit_identical_on_a_qkv_view(dtype):
    """The kernel rotates q inside the fused qkv output (a strided view) exactly as the eager
    x * cos + rotate_half(x) * sin rounds."""
    torch.manual_seed(2)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 13
    rotary = RotaryEmbedding(head_dim, 4096, 100000.0, dtype)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (tokens,)))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    expected = reference(lambda: apply_rotary(q, cos, sin))
    assert expected.data_ptr() != q.data_ptr()
    rotated = apply_rotary(q, cos, sin)
    assert rotated.data_ptr() == q.data_ptr()
    torch.testing.assert_close(rotated, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write_matches_index_copy(dtype):
    torch.manual_seed(3)
    blocks, block_size, kv_heads, head_dim = 6, 4, 3, 8
    k_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(5, 2 * kv_heads * head_dim).to(dtype)  # a strided view, like the qkv split
    k = kv[:, :kv_heads * head_dim].view(5, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim:].view(5, kv_heads, head_dim)
    slots = torch.tensor([3, 9, 10, 22, 0])
    cpu_kernels().write_kv_cache(k, v, k_cache, v_cache, slots)
    expected_k = torch.zeros_like(k_cache)
    expected_v = torch.zeros_like(v_cache)
    expected_k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    expected_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels().write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().linear_bf16_available(),
                    reason="no AVX-512 BF16 here")
@pytest.mark.parametrize("in_features", [576, 100])  # whole 32-wide chunks, and a masked tail
@pytest.mark.parametrize("out_features", [96, 112])  # AMX: blocks of 32 outputs, and one of 16
def test_few_rows_bf16_linear(in_features, out_features):
    """Close to the float product; a row's result doesn't depend on the rows beside it on one
    path (with AMX: VDPBF16PS tiles up to 2 rows, AMX tiles from 3, each pass's sums written out
    during the next); Linear takes the kernel up to FEW_ROWS_MAX rows."""
    torch.manual_seed(4)
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(layers.FEW_ROWS_MAX, in_features).bfloat16()
    out = cpu_kernels().linear_bf16(x, weight, bias)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=2 ** -7)
    for rows, more in ((1, 2), (3, layers.FEW_ROWS_MAX), (17, layers.FEW_ROWS_MAX)):
        assert torch.equal(cpu_kernels().linear_bf16(x[:rows], weight, bias),
                           cpu_kernels().linear_bf16(x[:more], weight, bias)[:rows])
    linear = layers.Linear(weight, bias)
    assert linear.few_rows_kernel
    assert torch.equal(linear(x), out)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        cpu_kernels().linear_bf16(x, weight[:95], None)


@pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().linear_bf16_available(),
                    reason="no AVX-512 BF16 here")
def test_few_rows_bf16_linear_reads_interleaved_rows_to_the_same_values():
    """W interleaved in blocks of four rows gives W's outputs bit for bit where both run the
    VDPBF16PS tile (1 to 4 rows a pass, several passes); Linear reads it where it applies
    (without AMX, whole chunks of 32 inputs) and hands the decode stack the same tensor."""
    torch.manual_seed(7)
    weight, bias = torch.randn(96, 576).bfloat16(), torch.randn(96).bfloat16()
    interleaved = layers.interleave_bf16(weight)
    assert interleaved.shape == (24, 18, 4, 32)
    assert torch.equal(interleaved[1, 2, 3], weight[4 + 3, 64:96])
    # with AMX, W as it lies goes to AMX tiles from 3 rows: the same values only up to 2
    for rows in (1, 2) if cpu_has_amx() else (1, 2, 3, 4, 5, 9, 32):
        x = torch.randn(rows, 576).bfloat16()
        assert torch.equal(cpu_kernels().linear_bf16(x, interleaved, bias),
                           cpu_kernels().linear_bf16(x, weight, bias)), rows
    linear = layers.Linear(weight, bias)
    assert (linear.few_rows_weight.dim() == 4) == (not cpu_has_amx())
    assert linear.decode_product().tensors[0] is linear.few_rows_weight
    assert layers.Linear(torch.randn(8, 100).bfloat16()).few_rows_weight.dim() == 2
    with pytest.raises(RuntimeError, match="K / 32"):
        cpu_kernels().linear_bf16(torch.randn(1, 544).bfloat16(), interleaved, None)


@pytest.mark.skipif(not layers._onednn_bf16(),
                    reason="oneDNN has no bfloat16 product on this CPU (AVX2 only)")
def test_bf16_linear_beyond_few_rows_multiplies_a_packed_copy():
    """Past FEW_ROWS_MAX rows a bfloat16 Linear multiplies oneDNN's packed copy of W: close to
    the float product at decode and prefill row counts, and the decode stack gets that copy."""
    torch.manual_seed(5)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    linear = layers.Linear(weight, bias)
    for rows in (layers.FEW_ROWS_MAX + 1, 33, 300):
        x = torch.randn(rows, 64).bfloat16()
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(linear(x).float(), expected, atol=0.05, rtol=2 ** -7)
    assert linear.packed is not None and linear.decode_product().tensors[1] is linear.packed
    assert layers.Linear(weight.float()).packed is None  # float32 keeps F.linear


def test_bf16_linear_keeps_f_linear_where_onednn_has_no_bfloat16(monkeypatch):
    """An AVX2-only CPU: oneDNN's bfloat16 reorder raises there, so the layer never packs."""
    monkeypatch.setattr(layers, "_onednn_bf16", lambda: False)
    torch.manual_seed(5)
    weight = torch.randn(96, 64).bfloat16()
    linear = layers.Linear(weight, None)
    x = torch.randn(layers.FEW_ROWS_MAX + 1, 64).bfloat16()
    assert linear.packed is None
    torch.testing.assert_close(linear(x).float(), torch.nn.functional.linear(x, weight).float())


@pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_gives_torch_argmax_first_index_on_ties(dtype):
    generator = torch.Generator().manual_seed(6)
    for n in (7, 16, 100, 49152):  # the scalar tail alone, one vector, vectors and a tail
        logits = torch.randn(5, n, generator=generator).to(dtype)
        logits[1] = 0.5  # every value tied: the first
        logits[2, n // 3] = logits[2, n - 1] = 10.0  # tied maxima in a lane and in the tail
        logits[3, n - 1] = 10.0  # the maximum in the tail
        assert torch.equal(cpu_kernels().argmax_rows(logits), logits.argmax(dim=-1))
    wide = torch.randn(4, 64, generator=generator).to(dtype)[:, :50]  # rows strided, not packed
    assert torch.equal(cpu_kernels().argmax_rows(wide), wide.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_mlp_silu_times_up_matches_pytorch(dtype):
    """GatedMLP's SiLU and product, one kernel in place in the gate's half: float32 bit for bit;
    bfloat16 rounds where eager does, but its exp is not Sleef's, so a value may move one
    bfloat16 ulp, and only rarely."""
    torch.manual_seed(3)
    width = 1536
    gate_up = torch.cat([torch.randn(40, width) * 4, torch.randn(40, width)], dim=1)
    gate_up[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 1e-30, 30.0, 100.0])  # the tails
    gate_up = gate_up.to(dtype)
    mlp = layers.GatedMLP(layers.Linear(torch.eye(2 * width, dtype=dtype)),
                          layers.Linear(torch.eye(width, dtype=dtype)))
    expected = reference(lambda: mlp.gate_up(gate_up)).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(expected[0]) * expected[1]
    kernel_input = gate_up.clone()
    out = cpu_kernels().silu_mul_(kernel_input)
    assert out.data_ptr() == kernel_input.data_ptr()  # in place, the gate's half
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
    else:
        differ = out != expected
        assert differ.float().mean() < 1e-3
        torch.testing.assert_close(out, expected, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(mlp(gate_up), reference(lambda: mlp(gate_up)),
                               atol=0 if dtype == torch.float32 else 1e-6, rtol=2 ** -7)
