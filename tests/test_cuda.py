"""The engine on a CUDA device: the CPU suite's invariants where a GPU runs the model.

Skipped without a GPU (CI has none); run on a lent GPU machine by benchmarks/cuda_check.sh. The
model runs through PyTorch's own ops there (SDPA over gathered blocks, cuBLAS products), the
quantized layers through aten's CUDA kernels (`_weight_int8pack_mm`, tinygemm's
`_weight_int4pack_mm`), and the sampler's torch path on the device.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.distributions import total_variation
from tests.near_ties import assert_parts_only_at_near_ties
from tests.prompts import CHAT_QUESTIONS, SYSTEM_PROMPT, varied_prompts
from tests.test_engine_bf16 import PARAMS as GREEDY  # greedy, 16 tokens, two logprobs
from tests.test_engine_bf16 import (check_batch_invariance,
                                    check_prefix_cache_preemption_and_chunked_prefill)
from tests.test_quant import token_ids
from tokenmill import SamplingParams
from tokenmill.model.layers import Linear
from tokenmill.model.sampler import Sampler
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import NO_ROW_LIMIT, QuantizedLinear
from tokenmill.quant.rotation import rotation_signs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


# ---- layers and the sampler, no model ---------------------------------------------------------

def cuda_layers(weight: torch.Tensor, bias: torch.Tensor,
                packed_max_rows: int | None) -> list[QuantizedLinear]:
    rotation = rotation_signs(weight.shape[1], weight.device)
    return [Int8Linear.quantize(weight, bias, packed_max_rows),
            Int4Linear.quantize(weight, 32, bias, packed_max_rows),
            Int4Linear.quantize(weight, 128, bias, packed_max_rows),
            Int4Linear.quantize(weight, 128, bias, packed_max_rows, input_rotation=rotation)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_layers_on_cuda_match_the_float_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 576, generator=generator) * 0.05).to(CUDA, dtype)
    bias = torch.randn(256, generator=generator).to(CUDA, dtype)
    # The default path (None) against a twin that always de-quantizes (0): the float reference
    # is the twin's weight in a cuBLAS product.
    for layer, twin in zip(cuda_layers(weight, bias, None), cuda_layers(weight, bias, 0)):
        if dtype == torch.bfloat16:  # aten's CUDA kernels take every row count
            assert layer.packed_max_rows == NO_ROW_LIMIT, type(layer)
        reference_weight = twin.dequantize().to(dtype)
        assert reference_weight.is_cuda
        for rows in (1, 3, 8, 17, 64, 256):
            x = torch.randn(rows, 576, generator=generator).to(CUDA, dtype)
            out = layer(x)
            assert out.is_cuda and out.dtype == dtype and out.shape == (rows, 256)
            expected = F.linear(twin.rotated(x), reference_weight, bias)
            # bf16: the kernels and cuBLAS round their sums differently, within bf16's steps
            tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
            torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
            assert (out.float() - F.linear(x, weight, bias).float()).abs().mean() < 0.1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8),
                                    SamplingParams(temperature=1.0, min_p=0.1)])
def test_sampler_draws_on_cuda_follow_the_shaped_distribution(params: SamplingParams) -> None:
    vocab, draws = 12, 40000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    logits = row.expand(draws, vocab).contiguous().to(CUDA)
    expected = Sampler.shaped_probs(row.unsqueeze(0).clone(), [params])[0]
    out = Sampler(0)(logits, [params] * draws, [None] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()
    drawn = counts / counts.sum()
    assert total_variation(drawn, expected) < 0.02
    assert drawn[expected == 0].sum() == 0


# ---- SmolLM2 on the GPU -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def cuda_fp32(make_llm):
    return make_llm(device="cuda")


@pytest.fixture(scope="module")
def cuda_bf16(make_llm):
    return make_llm(device="cuda", dtype="bfloat16")


def test_weights_and_kv_pool_live_on_the_gpu(cuda_bf16) -> None:
    runner = cuda_bf16.engine.runner
    assert all(p.is_cuda for p in runner.model.parameters())
    assert all(k.is_cuda and v.is_cuda for k, v in runner.kv_caches)


def test_fp32_greedy_tokens_match_transformers_on_cuda(cuda_fp32, hf_smollm) -> None:
    """test_hf_parity's 8 chat prompts and 32 tokens, both models on the GPU. cuBLAS and SDPA
    sum in other orders than the CPU, so a path may part where HF's top two logits are within
    1e-3 (an fp32 rounding apart), nowhere else."""
    hf = copy.deepcopy(hf_smollm).to(CUDA)
    hf.generation_config.eos_token_id = None
    engine = cuda_fp32.engine
    prompts = [engine.tokenizer.encode(engine.apply_chat_template(
        [{"role": "user", "content": q}]), add_special_tokens=False) for q in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = token_ids(cuda_fp32.generate(prompts, params))
    for prompt, tokens in zip(prompts, ours):
        with torch.inference_mode():
            result = hf.generate(torch.tensor([prompt], device=CUDA), max_new_tokens=32,
                                 do_sample=False, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
        reference = result.sequences[0, len(prompt):].tolist()
        parted = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
        if parted is not None:
            scores = result.scores[parted][0]
            gap = (scores[reference[parted]] - scores[tokens[parted]]).item()
            assert gap < 1e-3, (prompt, parted, gap)


def test_bf16_batch_invariance_on_cuda(cuda_bf16) -> None:
    check_batch_invariance(cuda_bf16)


def test_prefix_cache_preemption_and_chunked_prefill_on_cuda(make_llm, cuda_bf16) -> None:
    check_prefix_cache_preemption_and_chunked_prefill(make_llm, cuda_bf16, device="cuda")


def test_seeded_sampling_on_cuda_is_reproducible_and_top_k_1_is_greedy(cuda_bf16) -> None:
    prompts = varied_prompts(4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, seed=1234, max_tokens=16,
                            ignore_eos=True, logprobs=1)
    first = cuda_bf16.generate(prompts, seeded)
    assert token_ids(cuda_bf16.generate(prompts, seeded)) == token_ids(first)
    assert all(len(o.outputs[0].logprobs) == 16 for o in first)
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert token_ids(cuda_bf16.generate(prompts, top1)) == token_ids(
        cuda_bf16.generate(prompts, greedy))


def test_ngram_speculation_on_cuda_keeps_greedy_output(make_llm, cuda_bf16) -> None:
    prompts = [SYSTEM_PROMPT[:400] + " Repeat the first sentence of the text above."]
    speculative = make_llm(device="cuda", dtype="bfloat16", speculative_method="ngram",
                           num_speculative_tokens=4)
    assert_parts_only_at_near_ties(speculative.generate(prompts, GREEDY),
                                   cuda_bf16.generate(prompts, GREEDY), cuda_bf16)


def test_sampled_speculation_on_cuda_is_reproducible(make_llm) -> None:
    """The rejection sampler draws through the plain sampler's torch path on the device: a seeded
    request repeats itself, with logprobs, and keeps proposals."""
    # No prefix cache: the second run computes what the first did, step for step.
    speculative = make_llm(device="cuda", dtype="bfloat16", speculative_method="ngram",
                           num_speculative_tokens=4, speculative_adaptive=False,
                           enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True,
                            logprobs=1)
    prompts = [SYSTEM_PROMPT[:400] + " Repeat the first sentence of the text above."]
    first, second = (speculative.generate(prompts, params) for _ in range(2))
    assert token_ids(first) == token_ids(second)
    assert len(first[0].outputs[0].logprobs) == 24
    assert speculative.engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_on_cuda_keeps_the_engine_invariants(make_llm, quantization) -> None:
    llm = make_llm(device="cuda", dtype="bfloat16", quantization=quantization,
                   quant_group_size=128)
    runner = llm.engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 30 * 4 + 1 and all(m.packed_max_rows == NO_ROW_LIMIT for m in layers)
    assert runner.model_bytes < {"int8": 0.6, "int4": 0.4}[quantization] * runner.float_model_bytes
    [answer] = llm.generate(["The capital of France is"], GREEDY)
    assert "Paris" in answer.outputs[0].text
    prompts = varied_prompts(6)
    batched = llm.generate(prompts, GREEDY)
    assert_parts_only_at_near_ties(batched, [llm.generate([p], GREEDY)[0] for p in prompts], llm)
    prompt = SYSTEM_PROMPT[:300] + " Question: what are the support hours?"
    [first] = llm.generate([prompt], GREEDY)
    [second] = llm.generate([prompt], GREEDY)
    assert second.num_cached_tokens >= 48
    assert_parts_only_at_near_ties([second], [first], llm)


def test_gguf_model_on_cuda_gives_the_float_models_numbers(make_llm, cuda_bf16) -> None:
    """GGUF blocks de-quantize to the very weights the float model holds, and on CUDA both go
    through the same bf16 product: the same tokens and logprobs."""
    llm = make_llm(device="cuda", dtype="bfloat16", quantization="gguf")
    model, reference = llm.engine.runner.model, cuda_bf16.engine.runner.model
    for name, float_layer in [(n, m) for n, m in reference.named_modules()
                              if isinstance(m, Linear)][:8]:
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantizedLinear) and layer.codes.is_cuda, name
        assert torch.equal(layer.dequantize().to(torch.bfloat16), float_layer.weight), name
    prompts = ["The capital of France is", SYSTEM_PROMPT[:300]]
    for quantized, expected in zip(llm.generate(prompts, GREEDY),
                                   cuda_bf16.generate(prompts, GREEDY)):
        assert quantized.outputs[0].token_ids == expected.outputs[0].token_ids
        assert quantized.outputs[0].logprobs == expected.outputs[0].logprobs


def test_int8_kv_cache_on_cuda_doubles_capacity_and_keeps_output(make_llm, cuda_bf16) -> None:
    options = dict(device="cuda", dtype="bfloat16", num_kv_blocks=None, kv_cache_memory=0.25)
    plain, int8 = make_llm(**options), make_llm(kv_cache_dtype="int8", **options)
    ratio = int8.engine.runner.kv_capacity_tokens / plain.engine.runner.kv_capacity_tokens
    assert 1.8 < ratio < 2.0
    prompts = varied_prompts(4)
    assert_parts_only_at_near_ties(int8.generate(prompts, GREEDY),
                                   cuda_bf16.generate(prompts, GREEDY), cuda_bf16, margin=1.0)
