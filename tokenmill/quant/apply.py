"""Turns a built float model into a quantized one, as EngineConfig.quantization and quant_method
say, and counts a model's bytes.

Every `Linear` (the fused decoder products and the lm_head) and the embedding are swapped for
quantized layers in place; a tied embedding looks its rows up in the lm_head's quantized weight.
Norms, biases and the rotary table stay float. It never touches attention or the KV cache.

int4 with quant_method gptq runs calibration through the model a decoder layer at a time: the
layer's products are quantized by GPTQ from the Hessians of their inputs, then the calibration
runs through the quantized layer to give the next layer its inputs, so each layer corrects the
errors of the ones before it; the lm_head's inputs are the final-norm hidden states. An untied
embedding is only looked up, so it has no Hessian and is rounded to nearest (and not rotated).
The -hadamard methods quantize each product, the lm_head's too, as W R for a fixed orthogonal R
(tokenmill/quant/rotation.py) and rotate its inputs at run time; GPTQ then sees the Hessian of
the rotated inputs, R^T H R. The -distill method then fits every int4 product's scales and mins
end to end to the float model's next-token distributions (tokenmill/quant/distill.py).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenmill.model.layers import Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import GGUFBlocks, LoadedModel, read_gguf_blocks
from tokenmill.quant import cache, distill
from tokenmill.quant.calibration import (CALIBRATION_VERSION, LayerwiseCalibration,
                                         calibration_sequences, float32_sampler, sample)
from tokenmill.quant.gguf import gguf_linear
from tokenmill.quant.gptq import Hessian, gptq_levels
from tokenmill.quant.int4 import Int4Linear, pack_levels
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import QuantizedEmbedding, QuantizedLinear
from tokenmill.quant.rotation import BLOCK as ROTATION_BLOCK
from tokenmill.quant.rotation import SEED as ROTATION_SEED
from tokenmill.quant.rotation import rotate_hessian, rotate_input, rotation_signs

logger = logging.getLogger(__name__)


def quantize_model(model: LlamaForCausalLM, quantization: str, group_size: int,
                   loaded: LoadedModel, quant_method: str = "rtn") -> None:
    """`loaded` is what the model was built from: the gguf mode reads its file's blocks again,
    gptq its tokenizer for the calibration prompts."""
    if quantization == "none":
        return
    source = loaded.path
    blocks: dict[str, GGUFBlocks] = {}
    if quantization == "gguf":
        if source.suffix != ".gguf":
            raise ValueError(f"invalid engine option quantization='gguf': {source} is not a "
                             "GGUF file; use int8 or int4 for other models")
        blocks = read_gguf_blocks(source)
    tied = model.config.tie_word_embeddings
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    calibrated = _gptq_layers(model, dict(linears), group_size, loaded, quant_method) \
        if quantization == "int4" and quant_method.startswith("gptq") else {}
    for name, linear in linears:
        looks_up_rows = tied and linear is model.lm_head
        rotation = _input_rotation(linear, quant_method) if quantization == "int4" else None
        quantized = calibrated.get(name) or _quantize(linear, quantization, group_size, blocks,
                                                      looks_up_rows=looks_up_rows,
                                                      input_rotation=rotation)
        if quantized is not None:
            model.set_submodule(name, quantized)
    dtype = model.norm.weight.dtype
    if tied and isinstance(model.lm_head, QuantizedLinear):
        model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)
    elif not tied:
        # Only rows are looked up, so no packed kernel: packed_max_rows=0 skips packing.
        table = Linear(model.embed_tokens.weight, sources=("model.embed_tokens.weight",))
        quantized = _quantize(table, quantization, group_size, blocks, packed_max_rows=0)
        if quantized is not None:
            model.embed_tokens = QuantizedEmbedding(quantized, dtype)


def _input_rotation(linear: Linear, quant_method: str) -> torch.Tensor | None:
    """Every product's input rotation under the -hadamard methods, the lm_head's too: a tied
    one's embedding rows are turned back as they are looked up (QuantizedEmbedding). On
    SmolLM2 (int4 g128, GPTQ, the same decoder codes) the rotated lm_head took perplexity from
    +16.98% to +12.99% (`tokenmill eval --configs int4-g128`)."""
    if "-hadamard" not in quant_method:
        return None
    return rotation_signs(linear.weight.shape[1], linear.weight.device)


def _gptq_layers(model: LlamaForCausalLM, linears: dict[str, Linear], group_size: int,
                 loaded: LoadedModel, quant_method: str) -> dict[str, Int4Linear]:
    """`linears` (every Linear of `model`, by name) by GPTQ; from the disk cache when it has
    them."""
    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    act_order = quant_method != "gptq-in-order"
    method_key = {"input_rotation": (ROTATION_BLOCK, ROTATION_SEED, "lm_head too")} \
        if "-hadamard" in quant_method else {}
    if quant_method.endswith("-distill"):
        method_key["distill"] = (distill.DISTILL_VERSION, distill.NUM_SEQUENCES,
                                 distill.SEQUENCE_LENGTH, distill.LEARNING_RATE,
                                 distill.HELD_OUT)
    path = cache.cache_path(loaded.path, config=model.config, group_size=group_size,
                            act_order=act_order, dtype=str(dtype),
                            calibration=CALIBRATION_VERSION, codes="narrow-last-group",
                            **method_key)
    tensors = cache.load(path, device)
    if tensors is None:
        start = time.perf_counter()
        tensors = _run_gptq(model, group_size, loaded, act_order, quant_method)
        cache.save(path, tensors)
        logger.info("int4 by GPTQ in %.0f s, cached in %s", time.perf_counter() - start, path)
    tied = model.config.tie_word_embeddings
    return {name: _int4_layer(tensors, name, linear, looks_up_rows=tied and name == "lm_head",
                              input_rotation=_input_rotation(linear, quant_method))
            for name, linear in linears.items()}


def _int4_layer(tensors: dict[str, torch.Tensor], name: str, linear: Linear,
                looks_up_rows: bool = False,
                input_rotation: torch.Tensor | None = None) -> Int4Linear:
    return Int4Linear(tensors[f"{name}.codes"], tensors[f"{name}.scales"],
                      tensors[f"{name}.mins"], linear.weight.shape[1], linear.bias,
                      linear.weight.dtype, looks_up_rows=looks_up_rows,
                      input_rotation=input_rotation)


def _run_gptq(model: LlamaForCausalLM, group_size: int, loaded: LoadedModel,
              act_order: bool, quant_method: str) -> dict[str, torch.Tensor]:
    """Quantizes the model's layers in place, first to last, and returns their tensors."""
    sampler = float32_sampler(model, loaded)
    sequences = calibration_sequences(sampler, loaded)
    distilling = quant_method.endswith("-distill")
    if distilling:  # the float model's text and products, before GPTQ replaces them
        text = _distillation_text(sampler)
        teacher = distill.teacher_of(model)
    del sampler
    calibration = LayerwiseCalibration(model, sequences)
    tensors: dict[str, torch.Tensor] = {}

    def quantize(name: str, linear: Linear, hessian: Hessian) -> None:
        weight, matrix = linear.weight, hessian.matrix
        rotation = _input_rotation(linear, quant_method)
        if rotation is not None:  # GPTQ of W R on the inputs x R
            weight = rotate_input(weight.float(), rotation)
            matrix = rotate_hessian(matrix, rotation)
        levels, scales, mins = gptq_levels(weight, matrix, group_size, act_order)
        tensors.update({f"{name}.codes": pack_levels(levels, group_size, weight.shape[1]),
                        f"{name}.scales": scales, f"{name}.mins": mins})
        model.set_submodule(name, _int4_layer(tensors, name, linear, input_rotation=rotation))

    for index, layer in enumerate(model.layers):
        linears = {f"layers.{index}.{name}": m for name, m in layer.named_modules()
                   if isinstance(m, Linear)}
        hessians = {name: Hessian(m.weight.shape[1], m.weight.device)
                    for name, m in linears.items()}
        hooks = [m.register_forward_pre_hook(lambda _, args, h=hessians[name]: h.add(args[0]))
                 for name, m in linears.items()]
        calibration.run(layer)
        for hook in hooks:
            hook.remove()
        for name, linear in linears.items():
            quantize(name, linear, hessians[name])
        calibration.advance(layer)
    hessian = Hessian(model.lm_head.weight.shape[1], model.lm_head.weight.device)
    hessian.add(calibration.final_hidden(model))
    quantize("lm_head", model.lm_head, hessian)
    if distilling:
        _distill_scales(model, tensors, teacher, text)
    return tensors


def _distillation_text(sampler: LlamaForCausalLM) -> torch.Tensor:
    """The float model's sequences from random first tokens, a hundred at a time (the float32
    KV cache of all 400 at once would take 4.7 GB on SmolLM2)."""
    prompts = distill.distillation_prompts(sampler.config.vocab_size)
    chunks = [sample(sampler, prompts[i:i + 100], distill.SEQUENCE_LENGTH - 1,
                     distill.TEMPERATURE, distill.TOP_K, seed=distill.SEED + i)
              for i in range(0, len(prompts), 100)]
    return torch.tensor([s for chunk in chunks for s in chunk],
                        device=sampler.norm.weight.device)


def _distill_scales(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor],
                    teacher: tuple[dict, torch.Tensor], text: torch.Tensor) -> None:
    """GPTQ's scales and mins in `tensors` replaced by distillation's (the codes stay). An
    untied embedding is embedded float for both models: only the products are fitted."""
    student = {name: distill.TunableInt4Product(model.get_submodule(name))
               for name in distill.product_names(model)}
    embedding = None if model.config.tie_word_embeddings else teacher[1]
    start = time.perf_counter()
    fit = distill.distill(distill.ReferenceForward(model), teacher, student, embedding, text)
    logger.info("int4 scales distilled in %.0f s: held-out KL %.4f before, %.4f after %d of %d "
                "steps (the lowest measured)", time.perf_counter() - start, fit.held_out[0][1],
                fit.best_kl, fit.best_step, len(fit.losses))
    for name, product in student.items():
        scales, mins = product.scales_and_mins()
        tensors[f"{name}.scales"], tensors[f"{name}.mins"] = scales.detach(), mins.detach()


def _quantize(linear: Linear, quantization: str, group_size: int,
              blocks: dict[str, GGUFBlocks], packed_max_rows: int | None = None,
              looks_up_rows: bool = False,
              input_rotation: torch.Tensor | None = None) -> QuantizedLinear | None:
    """The quantized replacement of `linear`, or None where it stays float; int4 only takes
    an `input_rotation`."""
    if quantization == "int8":
        return Int8Linear.quantize(linear.weight, linear.bias, packed_max_rows)
    if quantization == "int4":
        return Int4Linear.quantize(linear.weight, group_size, linear.bias, packed_max_rows,
                                   looks_up_rows, input_rotation=input_rotation)
    return gguf_linear([blocks[source] for source in linear.sources], linear.bias,
                       linear.weight.dtype, linear.weight.device)


def model_bytes(model: nn.Module) -> int:
    """Bytes held by a model's parameters and buffers, a tensor shared by two layers once."""
    tensors = {t.data_ptr(): t.nbytes for t in (*model.parameters(), *model.buffers())}
    return sum(tensors.values())

