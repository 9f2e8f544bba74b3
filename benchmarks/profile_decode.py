"""Where a decode step's time goes: torch.profiler over engine steps at a given batch size.

Each of --batch-sizes runs its own batch: that many prompts (pydoc_data.topics slices of
--prompt-len tokens) are prefilled (timed: prefill tokens/s), a few decode steps warm up, then
--steps decode steps run timed (the step, and inside it the model's forward and the lm_head
product), and --steps more under the profiler. It prints the split and the top operators by self
CPU time, and saves them as JSON, so a note can quote the profile a missed target asks for.

    python benchmarks/profile_decode.py --batch-sizes 1,64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from pydoc_data.topics import topics
from torch.profiler import ProfilerActivity, profile

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, save_report  # noqa: E402


def profile_batch(engine: LLMEngine, batch_size: int, prompt_len: int, steps: int,
                  top: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                  logprobs: int | None = None) -> dict:
    text = "\n\n".join(topics[key] for key in sorted(topics))
    token_ids = engine.tokenize(text)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=0, logprobs=logprobs)
    for i in range(batch_size):
        engine.add_request(f"p{batch_size}-{i}", token_ids[i * prompt_len:(i + 1) * prompt_len],
                           params)
    start = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    prefill_s = time.perf_counter() - start
    for _ in range(3):  # warm-up decode steps
        engine.step()
    # Unprofiled first: the step, and inside it the model's forward and the lm_head product.
    timers = {"forward": 0.0, "logits": 0.0}
    model = engine.runner.model
    for name, method in (("forward", model.forward), ("logits", model.compute_logits)):
        setattr(model, method.__name__, _timed(method, timers, name))
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    del model.forward, model.compute_logits  # back to the class's methods
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    rows = [{"op": e.key, "calls_per_step": e.count / steps,
             "self_ms_per_step": e.self_cpu_time_total / steps / 1e3,
             "share": e.self_cpu_time_total / total_us} for e in events[:top]]
    ops_per_step = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    forward_ms, logits_ms = (timers[k] / steps * 1e3 for k in ("forward", "logits"))
    return {"batch_size": batch_size, "step_ms": step_ms,
            "decode_tokens_per_s": batch_size / step_ms * 1e3,
            "forward_ms": forward_ms, "lm_head_ms": logits_ms,
            "rest_of_step_ms": step_ms - forward_ms - logits_ms,
            "prefill_tokens_per_s": batch_size * prompt_len / prefill_s,
            "aten_ops_per_step": ops_per_step, "top_ops": rows}


def _timed(method, timers: dict[str, float], name: str):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = method(*args, **kwargs)
        timers[name] += time.perf_counter() - start
        return result
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", help="none, int8, int4 or gguf")
    parser.add_argument("--quant-group-size", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or int8")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--logprobs", type=int, default=None,
                        help="top logprobs a token (0: the chosen token's alone)")
    parser.add_argument("--output-json", type=Path,
                        default=REPO_ROOT / "benchmarks/results/profile_decode.json")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype,
                                    quantization=args.quantization,
                                    quant_group_size=args.quant_group_size,
                                    kv_cache_dtype=args.kv_cache_dtype))
    results = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        result = profile_batch(engine, batch_size, args.prompt_len, args.steps, args.top,
                               args.temperature, args.top_p, args.top_k, args.logprobs)
        results.append(result)
        print(f"\nbatch {batch_size}: {result['step_ms']:.1f} ms a step "
              f"(model {result['forward_ms']:.1f}, lm_head {result['lm_head_ms']:.1f}, the rest "
              f"{result['rest_of_step_ms']:.1f}), {result['decode_tokens_per_s']:.1f} tokens/s, "
              f"{result['aten_ops_per_step']:.0f} aten ops a step (profiled); prefill "
              f"{result['prefill_tokens_per_s']:.0f} tokens/s")
        print(f"{'op':<44}{'calls':>8}{'ms':>9}{'share':>8}")
        for row in result["top_ops"]:
            print(f"{row['op'][:43]:<44}{row['calls_per_step']:>8.0f}"
                  f"{row['self_ms_per_step']:>9.2f}{row['share']:>8.1%}")
    save_report(args.output_json, "profile_decode", model=args.model,
                dtype=str(engine.runner.dtype), quantization=args.quantization,
                quant_group_size=args.quant_group_size, kv_cache_dtype=args.kv_cache_dtype,
                temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, logprobs=args.logprobs,
                torch_threads=torch.get_num_threads(), results=results)


if __name__ == "__main__":
    main()
