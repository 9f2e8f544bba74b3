"""End-to-end distillation of int4's scales and mins after GPTQ (quant_method
`gptq-hadamard-distill`).

GPTQ fits each product to its own layer's outputs; what a user is served is the whole model's
next-token distribution. With GPTQ's codes fixed, every group's scale and min are fitted by Adam so
that the int4 model's next-token distributions match the float model's (KL divergence, the float
model as teacher): EfficientQAT's end-to-end stage. Scales and mins are all that move, so the
format, the kernels and the codes stay as GPTQ left them.

The text is the float model's own, sampled from random first tokens (LLM-QAT's data-free recipe):
no corpus ships with the engine and the evaluation text (`pydoc_data.topics`) is never seen. It has
to be plentiful. Fitted on GPTQ's 8,000 calibration tokens, the scales learned that text and lost
on the documentation (SmolLM2 +16.68% -> +17.09%); on 102,400 sampled tokens, seen once, SmolLM2's
int4 g128 went from +12.87% to +8.60%, and a second pass over them overfitted again. On
Qwen2.5-Coder-0.5B, whose int4 already meets its floor, the same fit lost (+3.57% -> +4.67%): its
KL started three times lower and the step size carried the scales past where they helped. So the
last HELD_OUT sequences are not fitted: their KL is measured before the fit and every EVAL_EVERY
steps, and the fit ends on the scales that gave the lowest, GPTQ's own when nothing was lower. It
stays an option, not the default: it costs minutes at the first load. (Each figure: `tokenmill eval
--configs int4-g128+gptq-hadamard-distill`; docs/quantization.md.)

The forward here is a plain differentiable one (whole sequences, causal attention, no KV cache, no
kernels), run under bfloat16 autocast; benchmarks/int4_error_budget.py scores with it too.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.model.layers import RotaryEmbedding, rms_norm, rotate_half
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.quant.int4 import Int4Linear, group_widths
from tokenmill.quant.rotation import BLOCK as ROTATION_BLOCK
from tokenmill.quant.rotation import rotation_matrix

logger = logging.getLogger(__name__)

DISTILL_VERSION = 2  # keys the quantization cache: bump when the data or the fit changes
NUM_SEQUENCES = 400
HELD_OUT = 16  # of NUM_SEQUENCES, never fitted: the KL the fit stops on
EVAL_EVERY = 16  # steps between two measurements of the held-out KL
SEQUENCE_LENGTH = 256  # tokens, the random first one included: 102,400 in all
TEMPERATURE, TOP_K = 1.0, 40
SEQUENCES_PER_STEP = 4
LEARNING_RATE = 1e-3  # on log-scale gains and on shifts in units of the scale; cosine decay
SEED = 1
PRODUCTS = ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down")


class FloatProduct:
    """A float product as the teacher runs it (autocast picks the matmul's dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class TunableInt4Product:
    """An Int4Linear's product with its codes fixed and W a differentiable function of its
    scales and mins: scale0 * exp(gain) and min0 + scale0 * shift, gain and shift from zero."""

    def __init__(self, layer: Int4Linear) -> None:
        self.layer = layer
        self.codes = layer.unpacked_codes().float()
        self.widths = torch.tensor(group_widths(layer.padded_in_features, layer.group_size),
                                   device=self.codes.device)
        self.scale0, self.min0 = layer.scales.float(), layer.mins.float()
        self.gain = torch.zeros_like(self.scale0, requires_grad=True)
        self.shift = torch.zeros_like(self.min0, requires_grad=True)
        self.rotation = None if layer.input_rotation is None \
            else rotation_matrix(layer.input_rotation.float())
        self.bias = None if layer.bias is None else layer.bias.float()

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale0 * self.gain.exp(), self.min0 + self.scale0 * self.shift

    def weight(self) -> torch.Tensor:
        """W R for a rotated product: the weight its rotated inputs meet."""
        scales, mins = self.scales_and_mins()
        weight = self.codes * scales.repeat_interleave(self.widths, dim=1) \
            + mins.repeat_interleave(self.widths, dim=1)
        return weight[:, :self.layer.in_features]

    def rows(self) -> torch.Tensor:
        """The rows as an embedding looks them up: W, the rotation undone."""
        weight = self.weight()
        if self.rotation is None:
            return weight
        return (weight.reshape(-1, ROTATION_BLOCK) @ self.rotation.T).view(weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            x = (x.reshape(-1, ROTATION_BLOCK) @ self.rotation.to(x.dtype)).view(x.shape)
        return F.linear(x, self.weight(), self.bias)


class ReferenceForward:
    """Logits [batch, length, vocab] of whole sequences (positions from 0, right padding
    allowed), differentiable, from `products` (a callable per product name) and an embedding
    table; the norms and rotary are the model's."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.config = config = model.config
        self.norms = [(layer.input_layernorm.weight.float(),
                       layer.post_attention_layernorm.weight.float()) for layer in model.layers]
        self.final_norm = model.norm.weight.float()
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, torch.float32,
                                      model.norm.weight.device)

    def __call__(self, products: dict, embedding: torch.Tensor,
                 input_ids: torch.Tensor) -> torch.Tensor:
        config = self.config
        batch, length = input_ids.shape
        sizes = [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
        cos = self.rotary.cos[:length].view(1, length, 1, -1)
        sin = self.rotary.sin[:length].view(1, length, 1, -1)
        x = embedding[input_ids].float()
        for index, (attention_norm, mlp_norm) in enumerate(self.norms):
            prefix = f"layers.{index}"
            q, k, v = products[f"{prefix}.self_attn.qkv"](self.norm(x, attention_norm)).split(
                sizes, dim=-1)
            q = rotate_half(q.view(batch, length, config.num_heads, -1), cos, sin)
            k = rotate_half(k.view(batch, length, config.num_kv_heads, -1), cos, sin)
            v = v.view(batch, length, config.num_kv_heads, -1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True,
                                                 enable_gqa=True)
            x = x + products[f"{prefix}.self_attn.o_proj"](out.transpose(1, 2).flatten(2))
            gate, up = products[f"{prefix}.mlp.gate_up"](self.norm(x, mlp_norm)).chunk(2, -1)
            x = x + products[f"{prefix}.mlp.down"](F.silu(gate) * up)
        return products["lm_head"](self.norm(x, self.final_norm))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.float(), weight, self.config.rms_norm_eps)


def product_names(model: LlamaForCausalLM) -> list[str]:
    return [f"layers.{i}.{part}" for i in range(len(model.layers)) for part in PRODUCTS] \
        + ["lm_head"]


def teacher_of(model: LlamaForCausalLM) -> tuple[dict[str, FloatProduct], torch.Tensor]:
    """The float model's products and embedding table, to be taken before quantization
    replaces its layers."""
    products = {name: FloatProduct(model.get_submodule(name).weight,
                                   model.get_submodule(name).bias)
                for name in product_names(model)}
    return products, model.embed_tokens.weight


def distillation_prompts(vocab_size: int) -> list[list[int]]:
    """One random first token a sequence (seeded)."""
    generator = torch.Generator().manual_seed(SEED)
    return [[t] for t in torch.randint(0, vocab_size, (NUM_SEQUENCES,),
                                       generator=generator).tolist()]


def kl_to_teacher(forward: ReferenceForward, teacher: tuple[dict, torch.Tensor],
                  student: tuple[dict, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions at every position."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16):
        with torch.no_grad():
            target = forward(*teacher, input_ids).float().log_softmax(-1)
        log_probs = forward(*student, input_ids).float().log_softmax(-1)
    return (target.exp() * (target - log_probs)).sum(-1).mean()


@dataclass
class DistillResult:
    losses: list[float]  # the training KL of each step
    held_out: list[tuple[int, float]]  # (steps taken, held-out KL), from 0 steps on

    @property
    def best_step(self) -> int:
        """The steps taken by the scales the student ends on: the first lowest held-out KL."""
        return min(self.held_out, key=lambda check: check[1])[0]

    @property
    def best_kl(self) -> float:
        return min(kl for _, kl in self.held_out)


def distill(forward: ReferenceForward, teacher: tuple[dict, torch.Tensor],
            student: dict[str, TunableInt4Product], embedding: torch.Tensor | None,
            sequences: torch.Tensor, learning_rate: float = LEARNING_RATE) -> DistillResult:
    """Fits the student's gains and shifts on `sequences` [n, length] but the last HELD_OUT,
    SEQUENCES_PER_STEP at a time, once through in a seeded order, and leaves the student on the
    gains and shifts whose KL on the held-out sequences was the lowest measured (every EVAL_EVERY
    steps, at 0 steps and at the end). `embedding` None: the student embeds with its (tied)
    lm_head's rows."""
    parameters = [p for product in student.values() for p in (product.gain, product.shift)]
    optimizer = torch.optim.Adam(parameters, lr=learning_rate)
    train, check = sequences[:-HELD_OUT], sequences[-HELD_OUT:]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED))
    num_steps = len(train) // SEQUENCES_PER_STEP
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / num_steps)))

    def table() -> torch.Tensor:
        return student["lm_head"].rows() if embedding is None else embedding

    @torch.no_grad()
    def held_out_kl() -> float:
        rows = table()
        chunks = check.split(SEQUENCES_PER_STEP)
        return sum(kl_to_teacher(forward, teacher, (student, rows), chunk).item() * len(chunk)
                   for chunk in chunks) / len(check)

    result = DistillResult([], [(0, held_out_kl())])
    best = [p.detach().clone() for p in parameters]
    start = time.perf_counter()
    for step in range(num_steps):
        rows = order[step * SEQUENCES_PER_STEP:(step + 1) * SEQUENCES_PER_STEP]
        loss = kl_to_teacher(forward, teacher, (student, table()), train[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        result.losses.append(loss.item())
        if (step + 1) % 10 == 0:
            logger.info("distilling int4 scales: step %d/%d, KL %.4f (%.0f s)", step + 1,
                        num_steps, sum(result.losses[-10:]) / 10, time.perf_counter() - start)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == num_steps:
            kl = held_out_kl()
            if kl < result.best_kl:
                best = [p.detach().clone() for p in parameters]
            result.held_out.append((step + 1, kl))
            logger.info("distilling int4 scales: held-out KL %.4f after %d steps (best %.4f "
                        "after %d)", kl, step + 1, result.best_kl, result.best_step)
    with torch.no_grad():
        for parameter, value in zip(parameters, best):
            parameter.copy_(value)
    return result
