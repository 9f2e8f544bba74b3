"""Tests for tokenmill.quant.gptq and its wiring: GPTQ writes the int4 format, beats round-to-nearest
on the output error of a layer with correlated inputs, and an engine quantized by it (a tiny
random-weight model, calibrated at load) keeps batch invariance and reads its disk cache back.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_tensor_parallel import greedy_tokens, tiny_prompts, write_tiny_model
from tokenmill import LLM, EngineConfig
from tokenmill.eval.configs import parse_config
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_model
from tokenmill.quant.calibration import (LayerwiseCalibration, _kv_caches, _prefill_inputs,
                                         calibration_sequences, float32_sampler)
from tokenmill.quant.gptq import Hessian, gptq_levels
from tokenmill.quant.int4 import Int4Linear, group_widths, pack_levels


def correlated_inputs(rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Inputs mixed across features, a few of them large, as a model's activations are."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.eye(in_features) + 2 * torch.randn(in_features, in_features,
                                                      generator=generator) / in_features ** 0.5
    x = torch.randn(rows, in_features, generator=generator) @ mixing
    x[:, :8] *= 10
    return x


def gptq_layer(weight: torch.Tensor, x: torch.Tensor, group_size: int,
               act_order: bool = False) -> Int4Linear:
    hessian = Hessian(weight.shape[1], weight.device)
    hessian.add(x)
    levels, scales, mins = gptq_levels(weight, hessian.matrix, group_size, act_order)
    return Int4Linear(pack_levels(levels, group_size, weight.shape[1]), scales, mins,
                      weight.shape[1], None,
                      weight.dtype)


def test_hessian_is_the_mean_of_twice_the_input_products() -> None:
    x = correlated_inputs(300, 64)
    hessian = Hessian(64, x.device)
    for part in x.split([100, 150, 50]):
        hessian.add(part)
    torch.testing.assert_close(hessian.matrix, 2 * x.T @ x / 300, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_writes_the_int4_format(group_size: int, act_order: bool) -> None:
    weight = torch.randn(48, 576, generator=torch.Generator().manual_seed(1)) * 0.05
    weight[0] = 0.0  # a zero row stays exactly zero: no error to spread
    layer = gptq_layer(weight, correlated_inputs(512, 576), group_size, act_order)
    widths = group_widths(576, group_size)  # in groups of 128: four, then one of 64
    assert layer.codes.dtype == torch.uint8 and layer.codes.shape == (48, sum(widths) // 2)
    assert layer.scales.shape == layer.mins.shape == (48, len(widths)) and sum(widths) == 576
    assert (layer.scales >= 0).all()
    assert layer.unpacked_codes().max() <= 15
    restored = layer.dequantize_padded()
    low = layer.mins.repeat_interleave(torch.tensor(widths), dim=1)
    high = low + 15 * layer.scales.repeat_interleave(torch.tensor(widths), dim=1)
    assert ((restored >= low - 1e-6) & (restored <= high + 1e-6)).all()
    assert torch.equal(layer.dequantize()[0], weight[0])


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_beats_round_to_nearest_on_the_layer_output(group_size: int,
                                                         act_order: bool) -> None:
    x = correlated_inputs(1024, 256)
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    reference = x @ weight.T

    def output_error(layer: Int4Linear) -> float:
        return float((x @ layer.dequantize().T - reference).norm() / reference.norm())

    rtn = output_error(Int4Linear.quantize(weight, group_size))
    assert output_error(gptq_layer(weight, x, group_size, act_order)) < 0.7 * rtn


def test_inputs_that_are_always_zero_leave_no_nan() -> None:
    x = correlated_inputs(256, 64)
    x[:, 5] = 0.0
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    layer = gptq_layer(weight, x, 32)
    assert torch.isfinite(layer.dequantize()).all()


def test_quant_method_is_validated_and_named_in_eval_configs() -> None:
    with pytest.raises(ValueError, match="invalid engine option quant_method='awq'"):
        EngineConfig(quantization="int4", quant_method="awq")
    assert parse_config("int4+gptq-hadamard").overrides == {"quantization": "int4",
                                                           "quant_method": "gptq-hadamard"}
    assert parse_config("int4-g32+rtn").overrides == {"quantization": "int4",
                                                      "quant_group_size": 32,
                                                      "quant_method": "rtn"}


@pytest.fixture(scope="module")
def tiny_gptq(tmp_path_factory, smollm):
    """A tiny Qwen2-shaped model (untied, q/k/v biases) quantized by GPTQ at load, and the
    folder of its quantization cache."""
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), smollm, "Qwen2ForCausalLM", 4, 2)
    cache = tmp_path_factory.mktemp("quant-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_QUANT_CACHE_DIR", str(cache))
        llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=8,
                  max_num_batched_tokens=64, debug_checks=True, quantization="int4",
                  quant_group_size=32, quant_method="gptq")
    return llm, folder, cache


def test_layerwise_calibration_gives_the_model_forward(tmp_path, smollm) -> None:
    """Run (the Hessians' pass) then advance, layer by layer as GPTQ does, ends on the hidden
    states of the model's own forward: running a layer leaves the stream it reads as it was (the
    layers add into their residual stream in place)."""
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    model = LLM(model=str(folder), dtype="float32", num_kv_blocks=64).engine.runner.model
    sequences = [list(range(3, 40)), list(range(50, 71))]
    calibration = LayerwiseCalibration(model, sequences)
    for layer in model.layers:
        calibration.run(layer)
        calibration.advance(layer)
    tables = [[0, 1, 2], [3, 4]]
    input_ids, positions, meta = _prefill_inputs(model, sequences, tables)
    with torch.inference_mode():
        expected = model(input_ids, positions, _kv_caches(model, len(model.layers), 5), meta)
    torch.testing.assert_close(calibration.final_hidden(model), expected, rtol=0, atol=0)


def test_calibration_answers_are_sampled_in_float32_whatever_the_served_dtype(
        tmp_path, smollm) -> None:
    """A bfloat16 model's calibration text is the float32 model's: bfloat16's rounding would
    draw other tokens (and give GPTQ other codes) whenever a kernel changed."""
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    loaded = load_model(str(folder), torch.bfloat16)
    served = LlamaForCausalLM(loaded.config, loaded.weights, torch.bfloat16)
    float32 = LlamaForCausalLM(loaded.config, loaded.weights, torch.float32)
    sequences = calibration_sequences(float32_sampler(served, loaded), loaded)
    assert sequences == calibration_sequences(float32_sampler(float32, loaded), loaded)
    assert len(sequences) == 33 and all(len(s) > 192 for s in sequences[1:])
    # however the weights were read: `tokenmill eval` reads them in float32 for every config
    read_in_float32 = load_model(str(folder), torch.float32)
    served_again = LlamaForCausalLM(loaded.config, read_in_float32.weights, torch.bfloat16)
    assert calibration_sequences(float32_sampler(served_again, read_in_float32),
                                 read_in_float32) == sequences


def test_gptq_engine_keeps_batch_invariance(tiny_gptq) -> None:
    llm = tiny_gptq[0]
    prompts = tiny_prompts()
    batched = greedy_tokens(llm, prompts, max_tokens=12)
    assert batched == [greedy_tokens(llm, [p], max_tokens=12)[0] for p in prompts]
    assert llm.engine.stats().num_kv_blocks_used == 0


def calibrated_again(*args, **kwargs):
    raise AssertionError("calibrated again instead of reading the disk cache")


def test_gptq_differs_from_rtn_and_its_cache_is_read_back(tiny_gptq, monkeypatch) -> None:
    llm, folder, cache = tiny_gptq
    [cached_file] = cache.iterdir()
    monkeypatch.setenv("TOKENMILL_QUANT_CACHE_DIR", str(cache))
    options = dict(model=str(folder), dtype="float32", num_kv_blocks=64, quantization="int4",
                   quant_group_size=32)
    with monkeypatch.context() as patch:  # the second load must read the file, not calibrate
        patch.setattr("tokenmill.quant.apply._run_gptq", calibrated_again)
        again = LLM(**options, quant_method="gptq").engine.runner.model
    rtn = LLM(**options, quant_method="rtn").engine.runner.model
    first = llm.engine.runner.model
    assert list(cache.iterdir()) == [cached_file]
    for name in ("layers.0.self_attn.qkv", "layers.1.mlp.down", "lm_head"):
        codes = first.get_submodule(name).codes
        assert torch.equal(again.get_submodule(name).codes, codes)
        assert not torch.equal(rtn.get_submodule(name).codes, codes)


def test_gptq_hadamard_rotates_every_products_inputs_and_keeps_batch_invariance(
        tmp_path, smollm, monkeypatch) -> None:
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    monkeypatch.setenv("TOKENMILL_QUANT_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=64, debug_checks=True, quantization="int4",
              quant_group_size=32, quant_method="gptq-hadamard")
    model = llm.engine.runner.model
    for name in ("layers.0.self_attn.qkv", "layers.0.self_attn.o_proj", "layers.1.mlp.gate_up",
                 "layers.1.mlp.down", "lm_head"):
        assert model.get_submodule(name).input_rotation is not None
    prompts = tiny_prompts()
    batched = greedy_tokens(llm, prompts, max_tokens=12)
    assert batched == [greedy_tokens(llm, [p], max_tokens=12)[0] for p in prompts]
