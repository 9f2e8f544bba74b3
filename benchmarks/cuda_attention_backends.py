"""Which of torch's CUDA SDPA backends compute tokenmill's attention correctly, and what each
does to SmolLM2's perplexity.

The first GPU run (one H100, 2026-12-06, `bash benchmarks/cuda_check.sh`) gave a bf16 perplexity
of 13.773 against 13.100 in fp32 and 13.101 through the same PyTorch ops in bf16 on the CPU. This
script finds where: SDPA's error on the model's shapes (9 query heads over 3 KV heads, head_dim
64; causal prefill with enable_gqa on transposed views, and the decode call's grouped layout),
against an fp32 reference, for each backend; then the perplexity with each backend alone
allowed.

    python benchmarks/cuda_attention_backends.py --output-json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tokenmill import LLM
from tokenmill.eval.perplexity import documentation_tokens, perplexity

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_commit, machine_info  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
            "all_but_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                              SDPBackend.MATH]}


def backend_context(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if BACKENDS[name] is None else sdpa_kernel(BACKENDS[name])


def prefill_errors(length: int) -> dict[str, float | str]:
    """PagedAttention._prefill's call: [T, H, D] views transposed to [H, T, D], causal, GQA."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tokens(heads: int) -> torch.Tensor:
        return torch.randn(length, heads, HEAD_DIM, device="cuda", generator=generator,
                           dtype=torch.bfloat16) * 2

    q, k, v = tokens(HEADS), tokens(KV_HEADS), tokens(KV_HEADS)
    group = HEADS // KV_HEADS
    reference = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float().repeat_interleave(group, 0),
        v.transpose(0, 1).float().repeat_interleave(group, 0), is_causal=True)
    errors: dict[str, float | str] = {}
    for name in BACKENDS:
        try:
            with backend_context(name):
                out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                     v.transpose(0, 1), is_causal=True,
                                                     enable_gqa=True)
            errors[name] = (out.float() - reference).abs().max().item()
        except RuntimeError as error:
            errors[name] = f"unavailable: {str(error).splitlines()[0][:120]}"
    return errors


def model_perplexities(tokens_count: int, window: int) -> dict[str, float | str]:
    results: dict[str, float | str] = {}
    # No prefix caching: every backend computes every window afresh.
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cuda",
              enable_prefix_caching=False)
    tokens = documentation_tokens(lambda text: llm.engine.tokenizer.encode(
        text, add_special_tokens=False), tokens_count)
    for name in BACKENDS:
        try:
            with backend_context(name):
                results[name] = perplexity(llm, tokens, window)
        except (RuntimeError, TypeError) as error:  # a failed step ends its requests unscored
            results[name] = f"unavailable: {str(error).splitlines()[0][:120]}"
        print(f"perplexity, SDPA {name}: {results[name]}", flush=True)
    fp32 = LLM("smollm2-135m-instruct", dtype="float32", device="cuda",
               enable_prefix_caching=False)
    results["float32 default"] = perplexity(fp32, tokens, window)
    print(f"perplexity, float32: {results['float32 default']}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--output-json", type=Path, required=True)
    args = parser.parse_args()
    prefill = {length: prefill_errors(length) for length in (64, 1000, 1024)}
    for length, errors in prefill.items():
        print(f"prefill {length} tokens, max |error| against fp32: {errors}", flush=True)
    report = {"benchmark": "cuda_attention_backends", "machine": machine_info("cuda"),
              "git": git_commit(), "prefill_max_abs_error": prefill,
              "perplexity": model_perplexities(args.num_tokens, args.window),
              "cudnn_version": torch.backends.cudnn.version()}
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
