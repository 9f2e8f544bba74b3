"""Where bench_engine.py's tokenmill run spends its time, step by step.

The same 64 prompts (20 to 300 tokens, 128 greedy output tokens each, EOS ignored) go through
`LLM.generate`; every engine step is timed and sorted into steps that prefill (with the decodes
beside them) and decode-only steps by row count. A second pass runs the same workload on the
eager layers (no C++ decode stack) with the attention kernel timed, so the cache bytes it reads
give its rate against the machine's memory (a plain sum over 1 GB, two threads, printed beside).

    python benchmarks/profile_engine_steps.py
    # bench_quant.py's concurrent workload, one weight format
    python benchmarks/profile_engine_steps.py --num-prompts 32 --quantization int4
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels
from tokenmill.model.loader import DEFAULT_MODEL, resolve_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_prompts  # noqa: E402
from common import REPO_ROOT, memory_sum_gb_per_s, save_report  # noqa: E402


def timed_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    runner = llm.engine.runner
    execute, steps = runner.execute, []

    def timed(scheduled):
        start = time.perf_counter()
        result = execute(scheduled)
        prefill = sum(c.num_new_tokens for c in scheduled.chunks if c.num_new_tokens > 1)
        decodes = sum(1 for c in scheduled.chunks if c.num_new_tokens == 1)
        steps.append((prefill, decodes, time.perf_counter() - start))
        return result

    runner.execute = timed
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    runner.execute = execute
    prefill_steps = [s for s in steps if s[0]]
    by_rows = defaultdict(list)
    for _, decodes, seconds in (s for s in steps if not s[0]):
        by_rows[decodes].append(seconds)
    return {
        "wall_s": wall, "output_tokens_per_s": len(prompts) * params.max_tokens / wall,
        "steps": len(steps),
        "prefill_steps": {"count": len(prefill_steps), "s": sum(s[2] for s in prefill_steps),
                          "prefill_tokens": sum(s[0] for s in prefill_steps)},
        "decode_only_steps": {str(rows): {"count": len(t), "mean_ms": 1e3 * sum(t) / len(t)}
                              for rows, t in sorted(by_rows.items())},
    }


def attention_rates(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Decode attention's time and cache read rate over the workload, by batch rows (eager)."""
    kernels, plan = cpu_kernels(), llm.engine.runner.model.decode_plan
    llm.engine.runner.model.decode_plan = None
    attend, stats = kernels.paged_decode_attention, defaultdict(lambda: [0, 0.0, 0])

    def timed(q, k_cache, v_cache, tables, lens, scale, out):
        start = time.perf_counter()
        attend(q, k_cache, v_cache, tables, lens, scale, out)
        key = "prefill" if tables.stride(0) == 0 else f"decode, {q.shape[0]} rows"
        entry = stats[key]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        entry[2] += int(lens.sum()) * 2 * k_cache[0, 0].numel() * k_cache.element_size()
    kernels.paged_decode_attention = timed
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        kernels.paged_decode_attention = attend
        llm.engine.runner.model.decode_plan = plan
    return {key: {"calls": n, "s": s, "ms_per_call": 1e3 * s / n, "cache_gb_per_s": b / s / 1e9}
            for key, (n, s, b) in sorted(stats.items()) if n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quantization", default="none",
                        help="a --quantization value (int4 takes group 128, as bench_quant.py)")
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/profile_engine_steps.json")
    args = parser.parse_args()
    prompts, warmup = build_prompts(resolve_model_path(args.model), args.num_prompts)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_prompts,
              quantization=args.quantization, quant_group_size=128)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([warmup], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    steps = timed_steps(llm, prompts, params)
    attention = attention_rates(llm, prompts, params) if cpu_kernels() is not None else {}
    memory = memory_sum_gb_per_s()
    print(f"wall {steps['wall_s']:.2f} s, {steps['output_tokens_per_s']:.1f} output tokens/s, "
          f"{steps['steps']} steps")
    p = steps["prefill_steps"]
    print(f"steps with prefill: {p['count']}, {p['s']:.2f} s for {p['prefill_tokens']} prompt "
          "tokens")
    for rows, d in steps["decode_only_steps"].items():
        print(f"decode-only steps of {rows:>2} rows: {d['count']:>3}, {d['mean_ms']:.1f} ms each")
    for key, a in attention.items():
        print(f"attention ({key}): {a['calls']} calls, {a['ms_per_call']:.3f} ms a call, "
              f"cache read at {a['cache_gb_per_s']:.1f} GB/s")
    print(f"memory: a sum over 1 GiB runs at {memory:.1f} GB/s")
    save_report(args.output_json, "profile_engine_steps", dtype=args.dtype,
                quantization=args.quantization, steps=steps,
                attention=attention, memory_sum_gb_per_s=memory,
                torch_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
