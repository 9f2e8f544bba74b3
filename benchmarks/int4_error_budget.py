"""Where int4's perplexity loss comes from: which products' rounding costs what.

The model is quantized as the engine does it (`quantize_model`: int4, GPTQ with Hadamard-rotated
inputs by default, from the quantization cache when it has the model), then scored by the plain
float32 forward of tokenmill/quant/distill.py (causal attention over whole windows, no KV cache,
no kernels), in which any subset of the products can be the int4 ones and the rest the float
model's. The text is `tokenmill eval`'s: the first 4,096 tokens of `pydoc_data.topics`, in 4
windows of 1,024.

    python benchmarks/int4_error_budget.py                      # gptq-hadamard, the default
    python benchmarks/int4_error_budget.py --quant-method gptq-hadamard-distill
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from tokenmill.eval.perplexity import documentation_tokens  # noqa: E402
from tokenmill.eval.report import EvalOptions  # noqa: E402
from tokenmill.model.llama import LlamaForCausalLM  # noqa: E402
from tokenmill.model.loader import DEFAULT_MODEL, load_model  # noqa: E402
from tokenmill.quant.apply import quantize_model  # noqa: E402
from tokenmill.quant.distill import (PRODUCTS, FloatProduct, ReferenceForward,  # noqa: E402
                                     TunableInt4Product, product_names)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_report  # noqa: E402

NUM_TOKENS, WINDOW = EvalOptions().num_tokens, EvalOptions().window  # tokenmill eval's defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--quant-method", default="gptq-hadamard")
    parser.add_argument("--output-json", type=Path,
                        default=Path("benchmarks/results/int4_error_budget.json"))
    args = parser.parse_args()

    loaded = load_model(args.model, torch.bfloat16)
    model = LlamaForCausalLM(loaded.config, loaded.weights, torch.bfloat16)
    names = product_names(model)
    float_products = {}
    for name in names:
        linear = model.get_submodule(name)
        bias = None if linear.bias is None else linear.bias.float()
        float_products[name] = FloatProduct(linear.weight.float(), bias)
    float_embedding = model.embed_tokens.weight.float()
    tied = model.config.tie_word_embeddings
    quantize_model(model, "int4", args.group_size, loaded, args.quant_method)
    int4_products = {name: TunableInt4Product(model.get_submodule(name)) for name in names}
    forward = ReferenceForward(model)
    windows = torch.tensor(documentation_tokens(loaded.tokenizer.encode, NUM_TOKENS)).view(
        -1, WINDOW)

    def int4_embedding() -> torch.Tensor:
        """A tied embedding's rows are the int4 lm_head's, its input rotation undone."""
        return int4_products["lm_head"].rows().detach() if tied else float_embedding

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
    for part in PRODUCTS:
        report(f"{part}, every layer", {n for n in names if n.endswith(part)}, float_embedding)
    num_layers = len(model.layers)
    span = max(1, num_layers // 6)  # six groups of layers
    for start in range(0, num_layers, span):
        end = min(num_layers, start + span)
        report(f"layers {start}-{end - 1}", {n for n in names[:-1]
                                             if start <= int(n.split(".")[1]) < end},
               float_embedding)
    save_report(args.output_json, "int4_error_budget", model=args.model,
                group_size=args.group_size, quant_method=args.quant_method,
                text={"source": "pydoc_data.topics", "tokens": NUM_TOKENS, "window": WINDOW},
                reference_perplexity=reference, rows=rows)
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
