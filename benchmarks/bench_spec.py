"""Speculative decoding against plain decoding, same weights, same prompts, one run.

(a) ngram: single-stream decode on rewrite prompts (a code edit, a JSON reformat, a summary
    that quotes), where the output copies much of the prompt. Target: >= 2x plain.
(b) draft: Qwen2.5-Coder-0.5B proposing for Qwen2.5-Coder-1.5B on code prompts, single-stream.
    Target: >= 1.6x the 1.5B alone, acceptance reported. Needs the two Qwen packages
    (`tokenmill` prints the pip command if they are missing).
(c) 16 and 32 concurrent requests, speculation (adaptive throttle on) against none: throughput.
    Target: >= 0.95x.

Greedy throughout: in fp32 each speculative run gives the plain run's tokens (the script
reports how much of the output agrees; in bf16 rounding can part the texts at a near tie).

    python benchmarks/bench_spec.py                      # all three parts, a few minutes
    python benchmarks/bench_spec.py --parts a,c --max-tokens 32 --concurrency 4   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_commit, machine_info  # noqa: E402

from tokenmill import LLM, EngineConfig, SamplingParams  # noqa: E402
from tokenmill.engine.engine import LLMEngine  # noqa: E402
from tokenmill.model.loader import DEFAULT_MODEL, LoadedModel, load_model  # noqa: E402

TARGETS = {"ngram_single_stream_speedup": 2.0, "draft_single_stream_speedup": 1.6,
           "concurrent_throughput_ratio": 0.95}

CODE = '''def compute_total(items, tax_rate):
    """Total price of the items, tax included."""
    subtotal = 0.0
    for item in items:
        if item.quantity <= 0:
            continue
        price = item.unit_price * item.quantity
        if item.discount:
            price = price * (1.0 - item.discount)
        subtotal += price
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.unit_price < best.unit_price:
            best = item
    return best


def report(items, tax_rate):
    total = compute_total(items, tax_rate)
    lines = [f"{item.name}: {item.quantity} x {item.unit_price}" for item in items]
    lines.append(f"total: {compute_total(items, tax_rate)}")
    return "\\n".join(lines), total
'''

JSON_DOC = ('{"id":4821,"name":"Ada Lovelace","email":"ada@example.org","active":true,'
            '"roles":["admin","editor"],"address":{"street":"12 St James Square","city":"London",'
            '"postcode":"SW1Y 4JH","country":"UK"},"preferences":{"theme":"dark","language":"en",'
            '"notifications":{"email":true,"sms":false}},"orders":[{"order_id":"A-1001",'
            '"total":42.5,"items":3},{"order_id":"A-1002","total":17.0,"items":1}],'
            '"created_at":"2024-03-01T10:15:00Z"}')

ARTICLE = (
    "The city council approved the new cycling plan on Tuesday after a three-hour debate. "
    "The plan adds forty kilometres of protected bike lanes over the next five years. "
    "Supporters said the lanes would cut traffic deaths and make short trips faster. "
    "Opponents argued that removing parking spaces would hurt small shops on the high street. "
    "The mayor promised that every affected business would be consulted before work begins. "
    "Construction of the first ten kilometres is expected to start next spring.")

REWRITE_PROMPTS = [
    "Rename the function compute_total to sum_prices everywhere in this code. Reply with the "
    f"complete code and nothing else.\n\n```python\n{CODE}```",
    f"Reformat this JSON document with two-space indentation, keeping every key and value:\n\n"
    f"{JSON_DOC}",
    "Summarize this article in a few sentences, quoting its key sentences word for word:\n\n"
    f"{ARTICLE}",
]

CODE_PROMPTS = [
    "Write a Python function that reads a CSV file and returns a list of dictionaries, one per "
    "row, with the header as keys. Include a docstring and type hints.",
    "Implement a binary search tree in Python with insert, search and in-order traversal "
    "methods.",
    "Write a JavaScript debounce function with a cancel method, and show how to use it.",
]

GENERAL_PROMPTS = [
    "What is the capital of France? Answer in one paragraph.",
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works.",
    "Give me three tips for learning a new language.",
    "Describe the water cycle for a ten-year-old.",
    "What are the pros and cons of remote work?",
    "Write a haiku about autumn and explain it.",
    "How does a bicycle stay upright?",
]


def make_llm(model: str, loaded: LoadedModel, args: argparse.Namespace, **options: Any) -> LLM:
    options = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
               "num_threads": args.threads, **options}
    llm = LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(model=model, **options), loaded))
    llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=8),
             use_tqdm=False)  # warm-up: kernels compiled, pools touched
    return llm


def single_stream(llm: LLM, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Each prompt alone; decode rate = (tokens - 1) / (last token time - first token time)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = llm.engine.stats().spec_decode
    tokens, seconds, outputs = 0, 0.0, []
    for prompt in prompts:
        [output] = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        m = output.metrics
        tokens += len(output.outputs[0].token_ids) - 1
        seconds += m.last_token_time - m.first_token_time
        outputs.append(output.outputs[0].token_ids)
    result = {"decode_tokens_per_s": tokens / seconds, "decode_tokens": tokens,
              "token_ids": outputs}
    return result | spec_summary(before, llm.engine.stats().spec_decode)


def concurrent(llm: LLM, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.engine.stats().spec_decode
    started = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                       use_tqdm=False)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens_per_s": tokens / wall, "wall_s": wall,
            "token_ids": [o.outputs[0].token_ids for o in outputs]} \
        | spec_summary(before, llm.engine.stats().spec_decode)


def spec_summary(before, after) -> dict[str, Any]:
    if after is None:
        return {}
    drafts = after.num_drafts - (before.num_drafts if before else 0)
    drafted = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
    accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "acceptance_rate_per_pos": after.acceptance_rate_per_pos,
            "num_throttled_steps": after.num_throttled_steps}


def compare(name: str, plain: dict[str, Any], spec: dict[str, Any], metric: str) -> dict:
    plain_ids, spec_ids = plain.pop("token_ids"), spec.pop("token_ids")
    # In fp32 the outputs are identical; in bf16 the verifying pass (a multi-token chunk) and
    # plain decode round differently, so a near tie can flip and the texts part from there.
    agreeing = sum(common_prefix(a, b) for a, b in zip(plain_ids, spec_ids))
    agreement = agreeing / max(sum(len(a) for a in plain_ids), 1)
    ratio = spec[metric] / plain[metric]
    print(f"  {name}: plain {plain[metric]:.1f} tok/s, speculative {spec[metric]:.1f} tok/s, "
          f"ratio {ratio:.2f}x, acceptance {spec.get('acceptance_rate', 0):.1%}, mean accepted "
          f"length {spec.get('mean_accepted_length', 0):.2f}, tokens before the outputs part "
          f"{agreement:.1%}")
    return {"plain": plain, "speculative": spec, "ratio": ratio,
            "identical_tokens": plain_ids == spec_ids, "agreeing_prefix_fraction": agreement}


def common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def run_ab(model: str, args: argparse.Namespace, base: dict[str, Any], spec: dict[str, Any],
           measure) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same measurement without and with speculation, one engine alive at a time."""
    loaded = load_model(model, EngineConfig(model=model, dtype=args.dtype).torch_dtype())
    results = []
    for options in (base, base | spec):
        llm = make_llm(model, loaded, args, **options)
        results.append(measure(llm))
        del llm
        gc.collect()
    return results[0], results[1]


def part_ngram(args: argparse.Namespace) -> dict[str, Any]:
    print(f"(a) ngram, single stream, rewrite prompts, {args.model}")
    spec = {"speculative_method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    plain, fast = run_ab(args.model, args, {}, spec,
                         lambda llm: single_stream(llm, REWRITE_PROMPTS, args.max_tokens))
    return {"model": args.model, "options": spec} | compare("ngram", plain, fast,
                                                            "decode_tokens_per_s")


def part_draft(args: argparse.Namespace) -> dict[str, Any]:
    print(f"(b) draft {args.draft_model} ({args.draft_quantization}) for {args.draft_target} "
          f"({args.target_quantization}), single stream, code prompts")
    spec = {"speculative_method": "draft", "speculative_model": args.draft_model,
            "speculative_quantization": args.draft_quantization,
            "num_speculative_tokens": args.num_speculative_tokens}
    plain, fast = run_ab(args.draft_target, args, {"quantization": args.target_quantization},
                         spec, lambda llm: single_stream(llm, CODE_PROMPTS, args.max_tokens))
    return {"target": args.draft_target, "target_quantization": args.target_quantization,
            "options": spec} | compare("draft", plain, fast, "decode_tokens_per_s")


def part_concurrent(args: argparse.Namespace) -> dict[str, Any]:
    print(f"(c) {args.concurrent_method}, concurrent requests, {args.model}")
    pool = REWRITE_PROMPTS + GENERAL_PROMPTS + CODE_PROMPTS
    spec = {"speculative_method": args.concurrent_method,
            "num_speculative_tokens": args.num_speculative_tokens}
    report: dict[str, Any] = {"model": args.model, "options": spec}
    for count in args.concurrency:
        prompts = [f"{pool[i % len(pool)]}\n\n(Request {i}.)" for i in range(count)]
        plain, fast = run_ab(args.model, args, {}, spec, lambda llm: concurrent(
            llm, prompts, args.concurrent_max_tokens))
        report[str(count)] = compare(f"{count} concurrent", plain, fast, "output_tokens_per_s")
    return report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="a,b,c", help="which of a (ngram), b (draft), "
                        "c (concurrency) to run")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="target of parts a and c")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per pool")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256, help="single-stream output cap")
    parser.add_argument("--draft-target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--target-quantization", default="none")
    parser.add_argument("--draft-quantization", default="int4")
    parser.add_argument("--concurrent-method", default="ngram")
    parser.add_argument("--concurrency", default="16,32",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--concurrent-max-tokens", type=int, default=96)
    parser.add_argument("--output-json", default="benchmarks/results/bench_spec.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    parts = {"a": ("ngram", part_ngram), "b": ("draft", part_draft),
             "c": ("concurrent", part_concurrent)}
    report: dict[str, Any] = {"command": " ".join(sys.argv), "machine": machine_info(),
                              "git": git_commit(), "targets": TARGETS}
    for key in args.parts.split(","):
        name, run = parts[key]
        report[name] = run(args)
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
