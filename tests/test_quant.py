"""Tests for tokenmill.quant: int8/int4 round trips and layers, GGUF's blocks served exactly, and
the engine's invariants on a quantized SmolLM2.

Layer tests use small random matrices and force each path (packed kernel, de-quantize + GEMM) at
every row count the crossover is measured at; model tests use the SmolLM2 weights conftest loads
once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GGMLType
from safetensors.torch import load_file, save_file

from tests.prompts import SYSTEM_PROMPT, varied_prompts
from tests.test_tensor_parallel import write_tiny_model
from tokenmill import LLM, EngineConfig, SamplingParams
from tokenmill.cli import add_engine_args, engine_config_from_args
from tokenmill.kernels import cpu_has_amx, cpu_kernels, fused_kernels
from tokenmill.model.layers import FEW_ROWS_MAX, PACKED_MAX_ROWS, Linear
from tokenmill.model.loader import GGUFBlocks
from tokenmill.quant.gguf import auto_group_size, auto_quantization, gguf_linear
from tokenmill.quant.int4 import Int4Linear, group_widths
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import NO_ROW_LIMIT, QuantizedEmbedding, QuantizedLinear, own_kernels
from tokenmill.quant.rotation import (rotate_input, rotation_matrix, rotation_signs,
                                      unrotate_input)

ROW_COUNTS = (1, 3, 8, 17, 37, 64, 256)
PACKED, DEQUANTIZE = NO_ROW_LIMIT, 0  # packed_max_rows forcing one path at every row count


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    weight[0] = 0.0  # a zero row and a constant group must come back exactly
    weight[1, :40] = 0.3  # a constant group
    return weight


# ---- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_dequantize_kernels_give_the_pytorch_paths_numbers(dtype: torch.dtype) -> None:
    """The C++ de-quantizers (one pass) against the PyTorch ops they replace: code * scale (+ min)
    in float32, then one rounding to the dtype; whole matrices, row slices and looked-up rows."""
    rows = torch.tensor([5, 0, 47, 5])
    for group_size in (32, 64, 128):
        layer = Int4Linear.quantize(random_weight(48, 600), group_size)
        widths = torch.tensor(group_widths(600, group_size))  # the last padded
        codes = layer.unpacked_codes().float()
        expected = (codes * layer.scales.repeat_interleave(widths, dim=1)
                    + layer.mins.repeat_interleave(widths, dim=1))
        assert torch.equal(layer.dequantize_padded(dtype=dtype), expected.to(dtype))
        assert torch.equal(layer.dequantize_padded(slice(8, 24), dtype), expected[8:24].to(dtype))
        assert torch.equal(layer.dequantize(rows, dtype), expected[rows, :600].to(dtype))
        # into a W without its padding columns (the kernel drops them; PyTorch's path keeps them)
        narrow = layer.dequantize_padded(dtype=dtype, out=torch.empty(48, 600, dtype=dtype))
        assert torch.equal(narrow[:, :600], expected[:, :600].to(dtype))
    for group_size in (576, 32):  # int8 mode's one scale a row; GGUF Q8_0's groups of 32
        codes = torch.randint(-127, 128, (48, 576), dtype=torch.int8)
        scales = torch.rand(48, 576 // group_size) * 0.01
        layer = Int8Linear(codes, scales, None, torch.float32, packed_max_rows=0)
        expected = (codes.view(48, -1, group_size).float() * scales.unsqueeze(-1)).view(48, 576)
        assert torch.equal(layer.dequantize_padded(dtype=dtype), expected.to(dtype))
        assert torch.equal(layer.dequantize(rows, dtype), expected[rows].to(dtype))



def test_int8_round_trip_is_within_half_a_step() -> None:
    weight = random_weight(48, 576)
    layer = Int8Linear.quantize(weight)
    error = (layer.dequantize() - weight).abs()
    assert (error <= layer.scales / 2 * (1 + 1e-6)).all()
    assert layer.codes.dtype == torch.int8 and layer.codes.abs().max() == 127
    assert torch.equal(layer.dequantize()[0], weight[0])


@pytest.mark.parametrize("group_size", [32, 64, 128])
# 576 in groups of 128: four and one of 64; 544: one of 32; 600: the last 88 padded to 128
@pytest.mark.parametrize("in_features", [256, 544, 576, 600])
def test_int4_round_trip_is_within_half_a_step(group_size: int, in_features: int) -> None:
    weight = random_weight(48, in_features)
    layer = Int4Linear.quantize(weight, group_size)
    restored = layer.dequantize()
    assert restored.shape == weight.shape
    step = layer.scales.repeat_interleave(group_size, dim=1)[:, :in_features]
    assert ((restored - weight).abs() <= step / 2 * (1 + 1e-5)).all()
    assert layer.unpacked_codes().max() == 15 and layer.unpacked_codes().min() == 0
    assert torch.equal(restored[0], weight[0])
    # 4 bits a weight, plus a float scale and min a group
    assert layer.codes.nbytes == 48 * layer.padded_in_features // 2


# ---- layers against a float reference, every path ---------------------------------------------

def layers(weight: torch.Tensor, bias: torch.Tensor | None, packed_max_rows: int | None,
           packed_kernel: str | None = None) -> list[QuantizedLinear]:
    """int8, int4 in groups of 32 and 128, and int4 of the rotated weight (quant_method
    *-hadamard)."""
    return [Int8Linear.quantize(weight, bias, packed_max_rows, packed_kernel),
            Int4Linear.quantize(weight, 32, bias, packed_max_rows, packed_kernel=packed_kernel),
            Int4Linear.quantize(weight, 128, bias, packed_max_rows, packed_kernel=packed_kernel),
            Int4Linear.quantize(weight, 128, bias, packed_max_rows, packed_kernel=packed_kernel,
                                input_rotation=rotation_signs(weight.shape[1]))]


OWN_KERNELS = own_kernels(torch.device("cpu"), torch.bfloat16, 96, 576) is not None
KERNELS = [pytest.param("tokenmill", marks=pytest.mark.skipif(
    not OWN_KERNELS, reason="tokenmill's int8/int4 kernels need AVX-512 BF16")), "aten"]
# tokenmill's kernels take bfloat16 activations only.
KERNEL_DTYPES = [pytest.param("tokenmill", torch.bfloat16, id="tokenmill-bf16",
                              marks=KERNELS[0].marks),
                 pytest.param("aten", torch.float32, id="aten-fp32"),
                 pytest.param("aten", torch.bfloat16, id="aten-bf16")]


def defined_weight(layer: QuantizedLinear) -> torch.Tensor:
    """W [out, in] in float32 from the layer's stored codes by each format's definition, not by
    its dequantize: an int8 code times its row's scale; an int4 code (a group's bytes hold its
    first half in their low nibbles, its second half in their high ones) times its group's scale,
    plus its group's min."""
    if isinstance(layer, Int8Linear):
        return layer.codes.float() * layer.scales.float()
    columns, start = [], 0
    for group, width in enumerate(group_widths(layer.padded_in_features, layer.group_size)):
        packed = layer.codes[:, start:start + width // 2]
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()
        columns.append(codes * layer.scales[:, group:group + 1].float()
                       + layer.mins[:, group:group + 1].float())
        start += width // 2
    return torch.cat(columns, dim=1)[:, :layer.in_features]


def defined_rotation(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """x R in float32 as a product with R itself (the layer rotates by a fast transform)."""
    if layer.input_rotation is None:
        return x.float()
    return (x.float().reshape(-1, 64) @ rotation_matrix(layer.input_rotation)).view(x.shape)


def activation_group(layer: QuantizedLinear, rows: int) -> int | None:
    """A run of x's values holding those whose int8 codes share a scale where tokenmill's int4
    kernel quantizes x (kernels/linear_quant.cpp: 16 values and the 16 half a group later up to
    a few rows, a group on AMX-INT8 tiles); None where x is multiplied as it is."""
    if layer.packed_kernel != "tokenmill" or rows > layer.packed_max_rows:
        return None
    if not isinstance(layer, Int4Linear):
        return None
    # kInt4TileMinGroup: AMX-INT8 tiles take every row count past the few-row tiles
    if cpu_has_amx() and layer.group_size >= 128:
        return layer.group_size
    # kInt8ActivationMaxRows, or kInt8ActivationMaxRowsWithAmx where AMX tiles take more rows
    return layer.group_size if rows <= (8 if cpu_has_amx() else 16) else None


@pytest.mark.parametrize("path", [PACKED, DEQUANTIZE, None], ids=["packed", "dequant", "auto"])
@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("out_features", [96, 128])  # 128: int4's lanes_product from 33 rows
def test_quantized_linear_matches_float_reference(dtype: torch.dtype, path: int | None,
                                                  kernel: str, out_features: int) -> None:
    weight = random_weight(out_features, 576).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for layer, twin in zip(layers(weight, bias, path, kernel), layers(weight, bias, DEQUANTIZE)):
        # The float reference: the stored codes by their definition (twin holds the same codes
        # where `layer` keeps only its kernel's copy), in a float32 GEMM of x R and W R for a
        # rotated layer, rounded once to dtype.
        reference_weight = defined_weight(twin)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(dtype)
            out = layer(x)
            assert out.dtype == dtype and out.shape == (rows, out_features)
            x_rotated = defined_rotation(twin, x)
            expected = F.linear(x_rotated, reference_weight, bias.float()).to(dtype)
            group = activation_group(layer, rows)
            if group is not None:
                # x meets the codes as int8 codes, each off by at most half its group's step
                # max |x| / 127; the rotation is unrounded there, x R is rounded to bf16 here.
                steps = F.pad(x_rotated, (0, -576 % group)).abs().unflatten(1, (-1, group))
                steps = steps.amax(-1).repeat_interleave(group, 1)[:, :576] / 127
                bound = (steps / 2 + x_rotated.abs() * 2**-8) @ reference_weight.float().abs().T
                error = (out.float() - expected.float()).abs()
                assert (error <= bound + expected.float().abs() * 2**-7 + 1e-3).all()
            else:
                torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
            # ... and the original float weight, within what quantization costs
            assert (out.float() - F.linear(x, weight, bias).float()).abs().mean() < 0.15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_rotation_is_orthogonal_and_its_kernel_gives_the_matrix_product(
        dtype: torch.dtype) -> None:
    signs = rotation_signs(576)
    rotation = rotation_matrix(signs)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(64), rtol=0, atol=1e-6)
    assert rotation_signs(100) is None  # a width 64 doesn't divide keeps its inputs
    x = torch.randn(5, 576).to(dtype)
    expected = (x.float().reshape(-1, 64) @ rotation).to(dtype).view(x.shape)
    out = rotate_input(x, signs)  # kernels/hadamard.cpp where it built
    assert out.dtype == dtype and out.shape == x.shape
    # the same sums in another order: float32 rounding, then at most one step of the dtype
    torch.testing.assert_close(out, expected, rtol=1e-6 if dtype == torch.float32 else 1e-2,
                               atol=1e-6)
    back = (out.float().reshape(-1, 64) @ rotation.T).view(x.shape)
    torch.testing.assert_close(back, x.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group_size", "in_features"), [(128, 576), (64, 576), (256, 640),
                                                         (32, 576)])
def test_rotated_int4_prefill_undoes_the_rotation_on_w_instead_of_rotating_x(
        dtype: torch.dtype, group_size: int, in_features: int) -> None:
    """Past packed_max_rows a rotated layer's de-quantize path gives W R R^T, the float W (a
    last group of 64 included), so x meets it unrotated; groups of 32 rotate x as before."""
    weight, bias = random_weight(96, in_features).to(dtype), torch.randn(96).to(dtype)
    # A row limit, as on every CPU with tokenmill's kernels: without one (aten's kernel on an
    # AVX2-only CPU) nothing de-quantizes and the layer keeps only the kernel's copy of W.
    layer = Int4Linear.quantize(weight, group_size, bias, packed_max_rows=PACKED_MAX_ROWS,
                                input_rotation=rotation_signs(in_features))
    restored = (layer.dequantize().float().reshape(-1, 64)
                @ rotation_matrix(layer.input_rotation).T).view(96, in_features)
    unrotated = layer.dequantize_unrotated(dtype, torch.empty(96, in_features, dtype=dtype))
    if unrotated is None:  # x is rotated instead
        assert group_size < 64 or fused_kernels(layer.codes) is None
    else:
        assert group_size >= 64
        # the same sums in another order: float32 rounding, then one rounding to dtype
        torch.testing.assert_close(unrotated.float(), restored.to(dtype).float(),
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    x = torch.randn(PACKED_MAX_ROWS + 3, in_features, generator=torch.Generator().manual_seed(5))
    expected = F.linear(x.to(dtype).float(), restored, bias.float())
    out = layer(x.to(dtype)).float()
    torch.testing.assert_close(out, expected, rtol=5e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rotated_lm_head_embeds_the_rows_its_product_multiplies_by(dtype: torch.dtype) -> None:
    """A tied lm_head stored as W R (int4's -hadamard methods): the embedding turns the rows it
    looks up back to W's, the same W the product gives logits with."""
    signs = rotation_signs(576)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(unrotate_input(rotate_input(x, signs), signs), x, rtol=0,
                               atol=1e-5)
    weight = random_weight(200, 576).to(dtype)
    head = Int4Linear.quantize(weight, 128, looks_up_rows=True, input_rotation=signs)
    embedding = QuantizedEmbedding(head, dtype)
    ids = torch.tensor([0, 5, 199, 5])
    rows = embedding(ids)
    assert rows.dtype == dtype and rows.shape == (4, 576)
    restored = (head.dequantize().reshape(-1, 64) @ rotation_matrix(signs).T).view(200, 576)
    torch.testing.assert_close(rows, restored[ids].to(dtype), rtol=1e-5, atol=1e-6)
    # close to the float rows, as an unrotated int4 lookup would be
    assert (rows.float() - weight[ids].float()).abs().max() < 0.1 * weight.float().abs().max()
    hidden = torch.randn(3, 576).to(dtype)
    torch.testing.assert_close(head(hidden).float(), hidden.float() @ restored.T,
                               rtol=5e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-4)


def test_input_rotation_lowers_the_int4_error_of_outlier_weights() -> None:
    """A few large weights a row stretch their group's range; rotated, they spread over 64
    inputs and every other weight of the group is rounded on a finer grid."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(128, 512, generator=generator) * 0.02
    outliers = torch.rand(weight.shape, generator=generator) < 0.01
    weight[outliers] *= 25
    x = torch.randn(256, 512, generator=generator)
    reference = x @ weight.T

    def error(layer: Int4Linear) -> float:
        return float((layer(x) - reference).norm() / reference.norm())

    rotated = Int4Linear.quantize(weight, 128, input_rotation=rotation_signs(512))
    assert error(rotated) < 0.6 * error(Int4Linear.quantize(weight, 128))


def test_paths_agree_and_keep_leading_dimensions() -> None:
    weight = random_weight(64, 256)
    x = torch.randn(2, 3, 256)
    for packed, dequantized in zip(layers(weight, None, PACKED), layers(weight, None, DEQUANTIZE)):
        torch.testing.assert_close(packed(x), dequantized(x), rtol=1e-5, atol=1e-5)
        assert packed(x).shape == (2, 3, 64)


def test_dequantize_path_in_slices_equals_one_float_gemm() -> None:
    # 2000 rows of 576 float32 are over 2 MiB: three slices of W, each with its slice of the bias
    layer = Int8Linear.quantize(random_weight(2000, 576), torch.randn(2000), DEQUANTIZE)
    for rows in (1, 64):
        x = torch.randn(rows, 576)
        assert torch.equal(layer(x), F.linear(x, layer.dequantize(), layer.bias))
    # int4 with a padded last group (600 inputs: groups of 128, the last 88 wide padded to 128):
    # the padding is left out of the product
    layer = Int4Linear.quantize(random_weight(96, 600), 128, torch.randn(96), DEQUANTIZE)
    assert layer.padded_in_features == 640
    x = torch.randn(7, 600)
    assert torch.equal(layer(x), F.linear(x, layer.dequantize(), layer.bias))


def test_always_packed_int4_keeps_one_copy_of_its_codes() -> None:
    weight = random_weight(64, 256)
    packed = Int4Linear.quantize(weight, 32, packed_max_rows=PACKED)
    assert packed.codes is None and packed.kernel_weight is not None
    lookup = Int4Linear.quantize(weight, 32, packed_max_rows=PACKED, looks_up_rows=True)
    assert torch.equal(lookup.dequantize(), Int4Linear.quantize(weight, 32).dequantize())


@pytest.mark.skipif(not OWN_KERNELS, reason="tokenmill's int8/int4 kernels need AVX-512 BF16")
@pytest.mark.parametrize("in_features", [544, 600])
def test_own_int4_kernels_take_a_narrow_or_padded_last_group(in_features: int) -> None:
    """Every path (int8 codes of x, widened codes, AMX tiles, de-quantize) reads a last group
    of 32 (544 in groups of 128) and one padded from 88 to 128 (600) as the codes say."""
    weight, bias = random_weight(96, in_features).bfloat16(), torch.randn(96).bfloat16()
    layer = Int4Linear.quantize(weight, 128, bias)
    assert layer.padded_in_features == {544: 544, 600: 640}[in_features]
    reference = layer.dequantize().bfloat16()
    for rows in ROW_COUNTS + (300,):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        expected = F.linear(x.bfloat16(), reference, bias).float()
        error = (layer(x.bfloat16()).float() - expected).abs().mean()
        assert error < 0.01 * expected.abs().mean(), rows


@pytest.mark.skipif(not OWN_KERNELS, reason="tokenmill's int8/int4 kernels need AVX-512 BF16")
def test_own_kernels_read_the_codes_and_give_each_row_the_same_result_on_one_path() -> None:
    weight, bias = random_weight(96, 576).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(16, 576).bfloat16()
    for layer in layers(weight, bias, PACKED):
        assert layer.packed_kernel == "tokenmill" and layer.codes is not None
        assert getattr(layer, "kernel_weight", None) is None  # no second, packed copy
        # Each row count runs one path (few-row tiles, int8 codes of x, or AMX tiles): within
        # a path a row's sums don't depend on the rows beside it.
        for few, more in ((1, 2), (9, 16)):
            assert torch.equal(layer(x[:few]), layer(x[:more])[:few])
    # a shape the kernels can't tile goes to aten's, and can't be forced onto them
    assert Int8Linear.quantize(random_weight(42, 256).bfloat16()).packed_kernel == "aten"
    with pytest.raises(ValueError, match="can't run this layer"):
        Int8Linear.quantize(random_weight(42, 256).bfloat16(), packed_kernel="tokenmill")


def test_int8_layers_aten_cannot_take_de_quantize_instead() -> None:
    # aten's CPU int8 kernel crashed the process from two rows when K is not a multiple of 16
    weight = random_weight(96, 600).bfloat16()
    layer = Int8Linear.quantize(weight, packed_kernel="aten")
    assert layer.packed_max_rows == 0
    x = torch.randn(4, 600, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.dequantize().bfloat16()))


@pytest.mark.skipif(not OWN_KERNELS, reason="tokenmill's int8/int4 kernels need AVX-512 BF16")
def test_own_kernels_give_the_same_numbers_whatever_ran_before() -> None:
    # The kernels keep x's codes and their scratch from call to call (kernels/scratch.cpp): a
    # narrow layer with a padded last group must read none of what a wider call left there.
    narrow = layers(random_weight(96, 600).bfloat16(), torch.randn(96).bfloat16(), PACKED)
    wide = layers(random_weight(96, 1536, seed=1).bfloat16(), None, PACKED)
    for rows in (1, 4, 9, 40):
        x = torch.randn(rows, 600, generator=torch.Generator().manual_seed(rows)).bfloat16()
        first = [layer(x) for layer in narrow]
        big = 1e4 * torch.randn(64, 1536, generator=torch.Generator().manual_seed(7)).bfloat16()
        for layer in wide:
            layer(big[:rows])
        for layer, before in zip(narrow, first):
            assert torch.equal(layer(x), before), (type(layer).__name__, rows)


@pytest.mark.skipif(not OWN_KERNELS, reason="tokenmill's int8/int4 kernels need AVX-512 BF16")
def test_int8_few_rows_meet_int16_codes_of_x_within_their_rounding() -> None:
    # Up to 4 rows x is quantized to int16 codes, q levels a row (kernels/linear_quant.cpp): the
    # error is x's rounding, half a step times |W|, plus the output's bfloat16 rounding.
    in_features = 1536
    weight, bias = random_weight(96, in_features).bfloat16(), torch.randn(96).bfloat16()
    layer = Int8Linear.quantize(weight, bias, PACKED)
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(3))
    x[1] *= 1000  # each row has its own scale
    x = x.bfloat16()
    restored = layer.dequantize().float()
    expected = F.linear(x.float(), restored, bias.float())
    levels = min(32767, (2**31 - 1) // (127 * in_features))
    step = x.float().abs().amax(1, keepdim=True) / levels
    bound = step / 2 * restored.abs().sum(1) + expected.abs() * 2**-8 + 1e-6
    assert ((layer(x).float() - expected).abs() <= bound).all()


@pytest.mark.skipif(not (OWN_KERNELS and cpu_has_amx()), reason="AMX tiles (kernels/linear_amx.cpp)")
@pytest.mark.parametrize("rows", [4, 9, 17, 40])
def test_amx_tiles_match_the_float_reference_on_part_filled_tiles(rows: int) -> None:
    # 112 outputs: three blocks of 32 and one of 16; 17 and 40 rows part-fill a tile of x
    weight, bias = random_weight(112, 576).bfloat16(), torch.randn(112).bfloat16()
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    for layer in layers(weight, bias, PACKED):
        expected = F.linear(layer.rotated(x).float(), layer.dequantize().float(), bias.float())
        out = layer(x)
        if activation_group(layer, rows) is None:  # int4 up to 8 rows meets x as int8 codes
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
        if rows >= 9:
            assert torch.equal(layer(x[:9]), out[:9])


def test_packed_path_is_skipped_where_the_kernel_cannot_run() -> None:
    # The CPU int4 packing works on 16-row blocks; Q8_0-style grouped int8 has no kernel.
    assert Int4Linear.quantize(random_weight(40, 256), 32).packed_max_rows == 0
    assert Int4Linear.quantize(random_weight(40, 256), 32).kernel_weight is None
    grouped = Int8Linear(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2), None,
                         torch.float32)
    assert grouped.packed_max_rows == 0


def test_embedding_looks_up_dequantized_rows() -> None:
    layer = Int4Linear.quantize(random_weight(64, 576), 128)
    embedding = QuantizedEmbedding(layer, torch.bfloat16)
    ids = torch.tensor([5, 0, 5, 63])
    assert torch.equal(embedding(ids), layer.dequantize()[ids].to(torch.bfloat16))


# ---- GGUF blocks: the same numbers as the loader's float weights ------------------------------

def gguf_blocks(values: np.ndarray, quant_type: GGMLType) -> GGUFBlocks:
    raw = gguf.quants.quantize(values, quant_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[quant_type]
    return GGUFBlocks(quant_type, torch.from_numpy(raw).view(len(values), -1, type_size))


def dequantized(parts: list[tuple[np.ndarray, GGMLType]]) -> torch.Tensor:
    return torch.cat([torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v, t), t))
                      for v, t in parts])


@pytest.mark.parametrize("types", [(GGMLType.Q8_0,), (GGMLType.Q4_0,), (GGMLType.Q4_1,),
                                   (GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q4_1)])
def test_gguf_blocks_map_exactly(types: tuple[GGMLType, ...]) -> None:
    rng = np.random.default_rng(0)
    parts = [((rng.standard_normal((32, 128)) * 0.1).astype(np.float32), t) for t in types]
    layer = gguf_linear([gguf_blocks(v, t) for v, t in parts], None, torch.float32,
                        torch.device("cpu"))
    expected = dequantized(parts)
    assert torch.equal(layer.dequantize(), expected)
    x = torch.randn(5, 128)
    assert torch.equal(layer(x), F.linear(x, expected))
    assert layer.packed_max_rows == 0


@pytest.mark.parametrize("types", [(GGMLType.Q8_0,), (GGMLType.Q4_0,), (GGMLType.Q4_1,),
                                   (GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q4_1)])
@pytest.mark.parametrize("in_features", [192, 224])
def test_gguf_layers_in_bfloat16_give_the_float_layers_numbers(types: tuple[GGMLType, ...],
                                                               in_features: int) -> None:
    """Where the bf16 float model multiplies by linear_bf16, the exact kernels widen the codes to
    its weights and sum as it does; past FEW_ROWS_MAX both run float_product (oneDNN's packed
    product, F.linear past PACKED_MAX_ROWS). K 224, an odd number of groups of 32, takes the
    int4 rows widened into a buffer where 192 widens them in registers."""
    rng = np.random.default_rng(1)
    parts = [((rng.standard_normal((32, in_features)) * 0.1).astype(np.float32), t)
             for t in types]
    bias = torch.randn(32 * len(types)).bfloat16()
    layer = gguf_linear([gguf_blocks(v, t) for v, t in parts], bias, torch.bfloat16,
                        torch.device("cpu"))
    float_layer = Linear(dequantized(parts).bfloat16(), bias)
    if float_layer.few_rows_kernel:
        assert layer.packed_max_rows == FEW_ROWS_MAX
    for rows in (1, 3, 4, 5, FEW_ROWS_MAX, FEW_ROWS_MAX + 1, 40, PACKED_MAX_ROWS,
                 PACKED_MAX_ROWS + 1, 2 * PACKED_MAX_ROWS + 3):
        x = torch.randn(rows, in_features).bfloat16()
        assert torch.equal(layer(x), float_layer(x)), rows


def test_gguf_types_without_an_exact_map_stay_float() -> None:
    values = np.ones((32, 64), np.float32)
    assert gguf_linear([gguf_blocks(values, GGMLType.F16)], None, torch.float32,
                       torch.device("cpu")) is None
    mixed = [gguf_blocks(values, GGMLType.Q8_0), gguf_blocks(values, GGMLType.Q4_0)]
    assert gguf_linear(mixed, None, torch.float32, torch.device("cpu")) is None


@pytest.fixture(scope="module")
def gguf_llm(make_llm):
    return make_llm(quantization="gguf")


def test_gguf_model_linear_outputs_equal_the_float_model(gguf_llm, llm_fp32) -> None:
    quantized, reference = gguf_llm.engine.runner.model, llm_fp32.engine.runner.model
    float_layers = [(n, m) for n, m in reference.named_modules() if isinstance(m, Linear)]
    assert len(float_layers) == 30 * 4 + 1  # every product and the tied lm_head
    generator = torch.Generator().manual_seed(0)
    for name, float_layer in float_layers:
        layer = quantized.get_submodule(name)  # Q4_1 -> int4, the lm_head's Q8_0 -> int8
        assert isinstance(layer, QuantizedLinear), name
        assert torch.equal(layer.dequantize(), float_layer.weight), name
        for rows in (1, 7, 64):
            x = torch.randn(rows, layer.in_features, generator=generator)
            assert torch.equal(layer(x), float_layer(x)), (name, rows)
    ids = torch.tensor([0, 17, 49151, 17])
    assert quantized.embed_tokens.weight is quantized.lm_head  # tied: one quantized copy
    assert torch.equal(quantized.embed_tokens(ids), reference.embed_tokens(ids))


def test_gguf_model_generates_the_float_models_tokens_and_logprobs(gguf_llm, llm_fp32) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    [quantized] = gguf_llm.generate(["The capital of France is"], params)
    [reference] = llm_fp32.generate(["The capital of France is"], params)
    assert quantized.outputs[0].token_ids == reference.outputs[0].token_ids
    assert quantized.outputs[0].logprobs == reference.outputs[0].logprobs


def test_gguf_model_in_bfloat16_generates_the_float_models_tokens_and_logprobs(make_llm) -> None:
    """Through the exact kernels and the C++ decode stack: the bf16 float model's numbers."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = ["The capital of France is", SYSTEM_PROMPT[:300]]
    outputs = [make_llm(dtype="bfloat16", quantization=q).generate(prompts, params, use_tqdm=False)
               for q in ("gguf", "none")]
    for quantized, reference in zip(*outputs):
        assert quantized.outputs[0].token_ids == reference.outputs[0].token_ids
        assert quantized.outputs[0].logprobs == reference.outputs[0].logprobs


def test_auto_serves_the_default_gguf_exactly_in_bfloat16(make_llm) -> None:
    """quantization="auto", the default, serves SmolLM2's Q4_1/Q8_0 file as gguf in bfloat16:
    the float model's tokens and logprobs from under half its weight bytes; float32 keeps the
    float model."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = ["The capital of France is", SYSTEM_PROMPT[:300]]
    assert make_llm(quantization="auto").engine.runner.quantization == "none"  # float32
    auto = make_llm(dtype="bfloat16", quantization="auto")
    # Read from the CPU, not from auto_quantization: the file is all Q4_1/Q8_0/float.
    kernels = cpu_kernels()
    if kernels is None or not kernels.linear_bf16_available():
        assert auto.engine.runner.quantization == "none"
        pytest.skip("no bfloat16 kernels on this CPU: auto serves the float model")
    assert auto.engine.runner.quantization == "gguf"
    none = make_llm(dtype="bfloat16", quantization="none")
    assert auto.engine.runner.model_bytes < 0.45 * none.engine.runner.model_bytes
    for served, reference in zip(auto.generate(prompts, params, use_tqdm=False),
                                 none.generate(prompts, params, use_tqdm=False)):
        assert served.outputs[0].token_ids == reference.outputs[0].token_ids
        assert served.outputs[0].logprobs == reference.outputs[0].logprobs


def _write_gguf(path: Path, quant_types: list[GGMLType]) -> Path:
    """A GGUF file of one 64 x 64 matrix of each type and a norm: only its header is read."""
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    for index, quant_type in enumerate(quant_types):
        values = rng.standard_normal((64, 64), dtype=np.float32)
        if quant_type in (GGMLType.F16, GGMLType.F32):
            dtype = np.float16 if quant_type == GGMLType.F16 else np.float32
            writer.add_tensor(f"blk.{index}.ffn_up.weight", values.astype(dtype))
        else:
            writer.add_tensor(f"blk.{index}.ffn_up.weight", gguf.quants.quantize(values, quant_type),
                              raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_auto_quantization_takes_gguf_only_where_it_is_exact_and_fast(tmp_path) -> None:
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    exact, partly = tmp_path / "exact.gguf", tmp_path / "partly.gguf"
    _write_gguf(exact, [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.F16])
    _write_gguf(partly, [GGMLType.Q4_1, GGMLType.Q5_0])
    kernels = own_kernels(cpu, bf16, 64, 64) is not None
    assert auto_quantization(exact, bf16, cpu, 1) == ("gguf" if kernels else "none")
    assert auto_quantization(exact, torch.float32, cpu, 1) == "none"
    assert auto_quantization(exact, bf16, torch.device("cuda"), 1) == "none"
    assert auto_quantization(exact, bf16, cpu, 2) == "none"  # no quantized tensor parallelism
    assert auto_quantization(partly, bf16, cpu, 1) == "none"  # a K-quant's or Q5's layers
    float_only = tmp_path / "float.gguf"
    _write_gguf(float_only, [GGMLType.F16])
    assert auto_quantization(float_only, bf16, cpu, 1) == "none"
    assert auto_quantization(tmp_path / "model.safetensors", bf16, cpu, 1) == "none"


def test_model_memory_falls(gguf_llm, make_llm) -> None:
    runner = gguf_llm.engine.runner
    assert runner.float_model_bytes > 500 * 2**20  # 135M float32 weights
    # Q4_1: 4 bits and two float32 a 32-value group; Q8_0 embedding: a byte and a float32 a 32
    assert runner.model_bytes < 0.3 * runner.float_model_bytes


def test_quantization_options_are_validated() -> None:
    with pytest.raises(ValueError, match="quantization='int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quant_group_size=48"):
        EngineConfig(quantization="int4", quant_group_size=48)
    with pytest.raises(ValueError, match="quant_group_size='big': must be auto, 32, 64 or 128"):
        EngineConfig(quantization="int4", quant_group_size="big")


def test_auto_group_size_is_64_over_4_bit_groups_of_32_else_128(tmp_path, smollm) -> None:
    types = gguf.GGMLQuantizationType
    assert auto_group_size(smollm.path) == 64  # SmolLM2's file: Q4_1 matrices, a Q8_0 embedding
    assert auto_group_size(_write_gguf(tmp_path / "q4.gguf", [types.Q4_0, types.Q4_0,
                                                                     types.Q8_0])) == 64
    assert auto_group_size(_write_gguf(tmp_path / "float.gguf", [types.F16, types.F32])) \
        == 128
    assert auto_group_size(_write_gguf(tmp_path / "q8.gguf", [types.Q8_0, types.Q8_0,
                                                                     types.Q4_1])) == 128


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_auto_group_size_over_a_float_checkpoint_is_128(tmp_path, smollm, dtype) -> None:
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    weights = load_file(folder / "model.safetensors")
    save_file({name: tensor.to(dtype) for name, tensor in weights.items()},
              folder / "model.safetensors")
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=16, quantization="int4",
              quant_method="rtn")
    assert llm.engine.config.quant_group_size == "auto"
    assert llm.engine.runner.quant_group_size == 128
    assert auto_group_size(folder) == 128


def test_int4_auto_group_size_on_the_built_in_model_is_64(make_llm) -> None:
    llm = make_llm(quantization="int4", num_kv_blocks=16)
    assert llm.engine.runner.quant_group_size == 64
    assert make_llm(quantization="int8", num_kv_blocks=16).engine.runner.quant_group_size is None


def test_quant_group_size_flag_takes_auto_or_a_number() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).quant_group_size == "auto"
    assert engine_config_from_args(
        parser.parse_args(["--quant-group-size", "64"])).quant_group_size == 64
    assert engine_config_from_args(
        parser.parse_args(["--quant-group-size", "auto"])).quant_group_size == "auto"


# ---- engine invariants on a quantized model ---------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_llm(request, make_llm):
    return make_llm(quantization=request.param, quant_group_size=128)


def test_quantized_model_is_smaller(quantized_llm) -> None:
    runner = quantized_llm.engine.runner
    limit = {"int8": 0.32, "int4": 0.2}[quantized_llm.engine.config.quantization]
    assert runner.model_bytes < limit * runner.float_model_bytes


def test_quantized_batch_invariance(quantized_llm) -> None:
    prompts = varied_prompts(3)
    batched = token_ids(quantized_llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [token_ids(quantized_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert batched == alone


def test_quantized_prefix_cache_hit_keeps_output(quantized_llm) -> None:
    prompt = SYSTEM_PROMPT[:300] + " Question: what are the support hours?"
    [first] = quantized_llm.generate([prompt], GREEDY, use_tqdm=False)
    [second] = quantized_llm.generate([prompt], GREEDY, use_tqdm=False)
    assert second.num_cached_tokens >= 48
    assert token_ids([second]) == token_ids([first])


def test_quantized_preemption_keeps_output(quantized_llm, make_llm) -> None:
    prompts = varied_prompts(3)  # 5, 15 and 18 tokens: 5 blocks of 16 by the end, in a pool of 4
    reference = token_ids(quantized_llm.generate(prompts, GREEDY, use_tqdm=False))
    config = quantized_llm.engine.config
    small = make_llm(quantization=config.quantization, quant_group_size=config.quant_group_size,
                     num_kv_blocks=4, block_size=16)
    outputs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert small.engine.stats().num_preemptions >= 1
    assert token_ids(outputs) == reference
    assert small.engine.stats().num_kv_blocks_used == 0
