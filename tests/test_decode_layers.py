"""The C++ decode stack (model/decode_layers.py) gives the eager model's hidden states bit for bit.

Every decode step that the plan takes is also run through the eager layers, on tiny random-weight
Llama and Qwen2 (q/k/v bias) models, in float32 and bfloat16, float and int8 / int4 (with and
without rotated inputs) weights, float and int8 KV caches, at batches from one sequence to more
than the few-row kernels take.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.test_tensor_parallel import TINY_VOCAB, greedy_tokens, tiny_prompts, write_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels
from tokenmill.model.layers import FEW_ROWS_MAX
from tokenmill.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ kernels on this machine")


def compare_every_planned_step(model: LlamaForCausalLM) -> list[int]:
    """From now on each step the plan takes runs eagerly too and must match; returns the growing
    list of those steps' batch sizes."""
    plan, forward, batches = model.decode_plan, model.forward, []

    def checked(input_ids, positions, kv_caches, meta):
        if not plan.runs(model.embed_tokens(input_ids), kv_caches, meta):
            return forward(input_ids, positions, kv_caches, meta)
        model.decode_plan = None  # the eager layers rewrite the step's K/V with the same values
        eager = forward(input_ids, positions, kv_caches, meta)
        model.decode_plan = plan
        planned = forward(input_ids, positions, kv_caches, meta)
        assert torch.equal(planned, eager)
        batches.append(input_ids.shape[0])
        return planned

    model.forward = checked
    return batches


def varied_prompts(count: int) -> list[list[int]]:
    prompts = tiny_prompts()
    return [prompts[i % len(prompts)] + [3 + i % (TINY_VOCAB - 3)] for i in range(count)]


@pytest.mark.parametrize("architecture,dtype,quantization,quant_method,kv_cache_dtype", [
    ("LlamaForCausalLM", "float32", "none", "rtn", "auto"),
    ("LlamaForCausalLM", "bfloat16", "none", "rtn", "auto"),
    ("Qwen2ForCausalLM", "bfloat16", "none", "rtn", "auto"),
    ("Qwen2ForCausalLM", "bfloat16", "int8", "rtn", "auto"),
    ("LlamaForCausalLM", "bfloat16", "int4", "rtn", "auto"),
    ("Qwen2ForCausalLM", "bfloat16", "int4", "rtn-hadamard", "auto"),
    ("LlamaForCausalLM", "float32", "none", "rtn", "int8"),
    ("Qwen2ForCausalLM", "bfloat16", "none", "rtn", "int8"),
])
def test_planned_decode_steps_equal_the_eager_model(tmp_path, smollm, architecture, dtype,
                                                    quantization, quant_method, kv_cache_dtype):
    folder = write_tiny_model(tmp_path / "tiny", smollm, architecture, 4, 2)
    llm = LLM(model=str(folder), dtype=dtype, quantization=quantization,
              quant_method=quant_method, quant_group_size=32, num_kv_blocks=1024, block_size=8,
              max_num_batched_tokens=8192, kv_cache_dtype=kv_cache_dtype, debug_checks=True)
    model = llm.engine.runner.model
    if dtype == "bfloat16" and not cpu_kernels().linear_bf16_available():
        pytest.skip("no AVX-512 BF16: the quantized layers take aten's kernels")
    assert model.decode_plan is not None
    batches = compare_every_planned_step(model)
    # One sequence at a time, then more at once than the few-row kernels take, so bfloat16's
    # steps take the packed oneDNN branch too.
    prompts = varied_prompts(FEW_ROWS_MAX + 8)
    tokens = greedy_tokens(llm, prompts, max_tokens=6)
    assert [greedy_tokens(llm, [prompt], max_tokens=6)[0] for prompt in prompts[:2]] == tokens[:2]
    assert 1 in batches and len(prompts) in batches


def test_steps_the_plan_leaves_to_python(tmp_path, smollm):
    """A mixed prefill and decode step runs eagerly."""
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    options = dict(model=str(folder), dtype="float32", num_kv_blocks=256, block_size=8,
                   max_num_batched_tokens=512)
    llm = LLM(**options)
    batches = compare_every_planned_step(llm.engine.runner.model)
    engine = llm.engine
    prompts = varied_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompts[0], params)
    engine.step()  # a's prefill
    engine.add_request("b", prompts[1], params)
    engine.step()  # a decodes beside b's prefill: eager
    assert batches == []
    engine.step()  # both decode
    assert batches == [2]
    while engine.has_unfinished_requests():
        engine.step()


def test_a_plan_lives_in_cpp_as_long_as_its_decode_plan(tmp_path, smollm):
    """The C++ side keeps each plan's tensors under a handle until the DecodePlan goes."""
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 2, 2)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=8)
    model = llm.engine.runner.model
    plan = model.decode_plan
    handle, other = plan.handle, LLM(model=str(folder), dtype="float32", num_kv_blocks=64,
                                     block_size=8).engine.runner.model.decode_plan.handle
    assert handle != other
    empty = torch.empty(0)

    def run(h: int) -> None:
        cpu_kernels().decode_layers(empty, empty, empty, empty, h, empty, empty, empty, 1, 1,
                                    1e-5, 1.0)

    with pytest.raises(RuntimeError, match="no plan"):
        run(-1)
    greedy_tokens(llm, varied_prompts(2), max_tokens=3)  # decodes through the plan
    model.decode_plan = plan = None
    del llm, model
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no plan {handle}"):
        run(handle)
