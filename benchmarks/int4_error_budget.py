"""Where int4's perplexity loss comes from, and whether tuning its scales end to end wins it back.

The model is quantized as the engine does it (`quantize_model`: int4, GPTQ with Hadamard-rotated
inputs by default, from the quantization cache when it has the model), then scored by a plain
float32 forward written here (causal attention over whole windows, no KV cache, no kernels), in
which any subset of the products can be the int4 ones and the rest the float model's. The text
is `tokenmill eval`'s: the first 4,096 tokens of `pydoc_data.topics`, in 4 windows of 1,024.

    python benchmarks/int4_error_budget.py                    # the budget: product kinds, layers
    python benchmarks/int4_error_budget.py --tune-epochs 6    # + end-to-end tuning of scales/mins

`--tune-epochs N` keeps the codes and fits every int4 product's scales and mins (scale0 *
exp(gain), min0 + scale0 * shift) by Adam so that the int4 model's next-token distribution
matches the float model's on GPTQ's own calibration sequences (KL divergence, the float model as
teacher), as EfficientQAT's end-to-end stage does; it then reports the calibration KL before and
after and the perplexity after. It is an experiment, not an engine option: on SmolLM2 it fitted
the calibration text and lost on the documentation (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from tokenmill.eval.perplexity import documentation_tokens  # noqa: E402
from tokenmill.eval.report import EvalOptions  # noqa: E402
from tokenmill.model.layers import RotaryEmbedding, rms_norm, rotate_half  # noqa: E402
from tokenmill.model.llama import LlamaForCausalLM  # noqa: E402
from tokenmill.model.loader import DEFAULT_MODEL, load_model  # noqa: E402
from tokenmill.quant.apply import quantize_model  # noqa: E402
from tokenmill.quant.calibration import calibration_sequences  # noqa: E402
from tokenmill.quant.int4 import Int4Linear, group_widths  # noqa: E402
from tokenmill.quant.rotation import BLOCK as ROTATION_BLOCK  # noqa: E402
from tokenmill.quant.rotation import rotation_matrix  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_report  # noqa: E402

PARTS = ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down")
NUM_TOKENS, WINDOW = EvalOptions().num_tokens, EvalOptions().window  # tokenmill eval's defaults
TOKENS_PER_STEP = 512
LEARNING_RATE = 2e-3


class FloatProduct:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.float()
        self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int4Product:
    """An Int4Linear's product in float32, its W a differentiable function of scales and mins."""

    def __init__(self, layer: Int4Linear) -> None:
        self.layer = layer
        self.codes = layer.unpacked_codes().float()
        self.widths = torch.tensor(group_widths(layer.padded_in_features, layer.group_size))
        self.scale0, self.min0 = layer.scales.float(), layer.mins.float()
        self.gain = torch.zeros_like(self.scale0, requires_grad=True)
        self.shift = torch.zeros_like(self.min0, requires_grad=True)
        self.rotation = None if layer.input_rotation is None \
            else rotation_matrix(layer.input_rotation.float())
        self.bias = None if layer.bias is None else layer.bias.float()

    def weight(self) -> torch.Tensor:
        scales = self.scale0 * self.gain.exp()
        mins = self.min0 + self.scale0 * self.shift
        weight = self.codes * scales.repeat_interleave(self.widths, dim=1) \
            + mins.repeat_interleave(self.widths, dim=1)
        return weight[:, :self.layer.in_features]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            x = (x.reshape(-1, ROTATION_BLOCK) @ self.rotation).view(x.shape)
        return F.linear(x, self.weight(), self.bias)


class Forward:
    """Logits [batch, length, vocab] in float32 of right-padded sequences; differentiable."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.config = config = model.config
        self.norms = [(layer.input_layernorm.weight.float(),
                       layer.post_attention_layernorm.weight.float()) for layer in model.layers]
        self.final_norm = model.norm.weight.float()
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, torch.float32)

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
        return rms_norm(x, weight, self.config.rms_norm_eps)


def padded_batches(sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of like length in steps of about TOKENS_PER_STEP tokens, right-padded: (ids,
    mask of the real positions)."""
    groups, current = [], []
    for sequence in sorted(sequences, key=len):
        if current and (len(current) + 1) * len(sequence) > TOKENS_PER_STEP:
            groups.append(current)
            current = []
        current.append(sequence)
    groups.append(current)
    batches = []
    for group in groups:
        ids = torch.zeros(len(group), max(map(len, group)), dtype=torch.long)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for row, sequence in enumerate(group):
            ids[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = True
        batches.append((ids, mask))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--quant-method", default="gptq-hadamard")
    parser.add_argument("--tune-epochs", type=int, default=0)
    parser.add_argument("--output-json", type=Path,
                        default=Path("benchmarks/results/int4_error_budget.json"))
    args = parser.parse_args()

    loaded = load_model(args.model, torch.bfloat16)
    model = LlamaForCausalLM(loaded.config, loaded.weights, torch.bfloat16)
    names = [f"layers.{i}.{part}" for i in range(len(model.layers)) for part in PARTS]
    names.append("lm_head")
    float_products = {name: FloatProduct(model.get_submodule(name).weight,
                                         model.get_submodule(name).bias) for name in names}
    float_embedding = model.embed_tokens.weight.float()
    tied = model.config.tie_word_embeddings
    sequences = calibration_sequences(model, loaded) \
        if args.tune_epochs else []
    quantize_model(model, "int4", args.group_size, loaded, args.quant_method)
    int4_products = {name: Int4Product(model.get_submodule(name)) for name in names}
    forward = Forward(model)
    windows = torch.tensor(documentation_tokens(loaded.tokenizer.encode, NUM_TOKENS)).view(
        -1, WINDOW)

    def int4_embedding() -> torch.Tensor:
        return int4_products["lm_head"].weight().detach() if tied else float_embedding

    @torch.no_grad()
    def perplexity(int4_names: set[str], embedding: torch.Tensor) -> float:
        products = {n: int4_products[n] if n in int4_names else float_products[n] for n in names}
        log_probs = forward(products, embedding, windows).log_softmax(-1)
        return math.exp(-log_probs[:, :-1].gather(-1, windows[:, 1:, None]).mean().item())

    reference = perplexity(set(), float_embedding)
    rows = []

    def report(label: str, int4_names: set[str], embedding: torch.Tensor) -> None:
        value = perplexity(int4_names, embedding)
        rows.append({"int4": label, "perplexity": value, "change_pct": 100 * (value / reference - 1)})
        print(f"{label:44s} {value:8.3f} {rows[-1]['change_pct']:+7.2f}%", flush=True)

    print(f"{'int4 products (the rest float)':44s} {'ppl':>8s} {'change':>8s}")
    print(f"{'none (float reference)':44s} {reference:8.3f}")
    report("all", set(names), int4_embedding())
    report("decoder layers (lm_head, embedding float)", set(names[:-1]), float_embedding)
    if tied:
        report("lm_head and its tied embedding", {"lm_head"}, int4_embedding())
    report("lm_head (embedding float)", {"lm_head"}, float_embedding)
    for part in PARTS:
        report(f"{part}, every layer", {n for n in names if n.endswith(part)}, float_embedding)
    num_layers = len(model.layers)
    span = max(1, num_layers // 6)  # six groups of layers
    for start in range(0, num_layers, span):
        end = min(num_layers, start + span)
        report(f"layers {start}-{end - 1}", {n for n in names[:-1]
                                             if start <= int(n.split(".")[1]) < end},
               float_embedding)
    tuning = tune(args.tune_epochs, forward, float_products, float_embedding, int4_products,
                  tied, sequences) if args.tune_epochs else None
    if tuning is not None:
        report(f"all, after {args.tune_epochs} epochs of end-to-end tuning", set(names),
               int4_embedding())
    save_report(args.output_json, "int4_error_budget", model=args.model,
                group_size=args.group_size, quant_method=args.quant_method,
                text={"source": "pydoc_data.topics", "tokens": NUM_TOKENS, "window": WINDOW},
                reference_perplexity=reference, rows=rows, tuning=tuning)
    print(f"wrote {args.output_json}")


def tune(epochs: int, forward: Forward, float_products: dict, float_embedding: torch.Tensor,
         int4_products: dict, tied: bool, sequences: list[list[int]]) -> dict:
    """Fits the int4 products' scales and mins to the float model's next-token distributions
    on the calibration sequences; returns the KL before and per epoch."""
    batches = padded_batches(sequences)
    with torch.no_grad():
        targets = [forward(float_products, float_embedding, ids).log_softmax(-1)[mask]
                   for ids, mask in batches]

    def embedding() -> torch.Tensor:
        return int4_products["lm_head"].weight() if tied else float_embedding

    def kl(ids: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = forward(int4_products, embedding(), ids).log_softmax(-1)[mask]
        return (target.exp() * (target - log_probs)).sum(-1).mean()

    with torch.no_grad():
        before = sum(kl(ids, mask, t).item() for (ids, mask), t in zip(batches, targets))
    parameters = [p for product in int4_products.values() for p in (product.gain, product.shift)]
    optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE)
    total = epochs * len(batches)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total)))
    per_epoch, start = [], time.perf_counter()
    for epoch in range(epochs):
        losses = []
        for (ids, mask), target in zip(batches, targets):
            loss = kl(ids, mask, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
        per_epoch.append(sum(losses) / len(losses))
        print(f"epoch {epoch + 1}: calibration KL {per_epoch[-1]:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    with torch.no_grad():
        after = sum(kl(ids, mask, t).item() for (ids, mask), t in zip(batches, targets))
    print(f"calibration KL: {before / len(batches):.4f} before, {after / len(batches):.4f} after")
    return {"epochs": epochs, "learning_rate": LEARNING_RATE, "tokens_per_step": TOKENS_PER_STEP,
            "calibration_tokens": sum(map(len, sequences)),
            "calibration_kl_before": before / len(batches),
            "calibration_kl_after": after / len(batches), "calibration_kl_per_epoch": per_epoch,
            "seconds": time.perf_counter() - start}


if __name__ == "__main__":
    main()
