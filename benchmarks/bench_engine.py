"""Offline throughput and single-stream decode: Hugging Face generate, generate_batch, tokenmill.

The same prompts (token slices of the Python docs shipped in `pydoc_data.topics`, 20 to 300 tokens
long) and the same weights go through every engine; each request makes exactly --output-len tokens.
Each engine runs alone in a fresh subprocess, one after another, so its peak RSS is its own.

This VM's speed moves up to 1.7x within the hour, and an engine's run lasts from 10 s to minutes,
so one run of each can compare a fast minute with a slow one (generate_batch gave 84.6 and 56.1
tokens/s in two runs ten minutes apart). With --rounds N every engine runs N times, the order
turning each round; each round's ratios compare runs minutes apart, and the report's ratios are
the medians of the rounds' (its per-engine figures the medians of the runs').

    python benchmarks/bench_engine.py --dtypes float32,auto
    python benchmarks/bench_engine.py --rounds 3
    python benchmarks/bench_engine.py --num-prompts 3 --output-len 8 --hf-sequential-prompts 1

Each round also runs llama.cpp's `llama-batched-bench` on the same GGUF file, where
scripts/build_peers.sh has built it, as the issue's batched reference: all the prompts at once
(--num-prompts sequences of the prompts' mean length, synthetic tokens: it takes no prompt
text) and one sequence alone, each making --output-len tokens. It is reported beside the
engines, not compared with a target.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from pydoc_data.topics import topics
from transformers import (AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig,
                          GenerationConfig)
from transformers.generation.streamers import BaseStreamer

from tokenmill import LLM, SamplingParams
from tokenmill.bench.peers import default_peers_dir
from tokenmill.config import EngineConfig
from tokenmill.model.loader import DEFAULT_MODEL, resolve_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, git_commit, machine_info  # noqa: E402

ENGINES = ("hf_generate", "hf_generate_batch", "tokenmill")
MIN_PROMPT_LEN, MAX_PROMPT_LEN, WARMUP_PROMPT_LEN = 20, 300, 32
TARGETS = {"tokenmill_over_hf_generate_batch_throughput": 15.0,
           "tokenmill_over_hf_generate_single_stream_decode": 4.0}
# transformers 5.17 (a GPU machine's) calls the KV page size block_size; 5.25 page_size.
PAGE_SIZE_FIELD = next(name for name in ("page_size", "block_size")
                       if name in ContinuousBatchingConfig.__dataclass_fields__)
Spec = dict[str, Any]  # what a worker subprocess is told to run
Result = dict[str, Any]  # what it reports back


# ---- the workload ----------------------------------------------------------------------------

def hf_source(model_path: Path) -> tuple[Path, dict[str, str]]:
    """from_pretrained's folder and keyword arguments for a GGUF file or a Hugging Face folder."""
    if model_path.is_dir():
        return model_path, {}
    return model_path.parent, {"gguf_file": model_path.name}


def build_prompts(model_path: Path, num_prompts: int) -> tuple[list[list[int]], list[int]]:
    """`num_prompts` disjoint token slices with lengths spread evenly over 20..300, in a shuffled
    (seeded) order so any first K of them span the range too; plus one more slice for warm-up."""
    folder, kwargs = hf_source(model_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    text = "\n\n".join(topics[key] for key in sorted(topics))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    step = (MAX_PROMPT_LEN - MIN_PROMPT_LEN) / max(1, num_prompts - 1)
    lengths = [MIN_PROMPT_LEN + round(i * step) for i in range(num_prompts)]
    random.Random(0).shuffle(lengths)
    if sum(lengths) + WARMUP_PROMPT_LEN > len(token_ids):
        raise ValueError(f"{num_prompts} prompts need more tokens than pydoc_data.topics has")
    slices, start = [], 0
    for length in [*lengths, WARMUP_PROMPT_LEN]:
        slices.append(token_ids[start:start + length])
        start += length
    return slices[:-1], slices[-1]


# ---- the engines, each run inside its own worker process ------------------------------------

class TokenClock(BaseStreamer):
    """Times each new token of model.generate; its first put() is the prompt, which is skipped."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


def run_hf_generate(spec: Spec) -> Result:
    """One request at a time; each request's token times give a single-stream decode rate."""
    model = _load_hf_model(spec, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # no EOS: every request runs to max_new_tokens
    output_len = spec["output_len"]

    def generate(prompt: list[int], max_new_tokens: int, clock: TokenClock | None) -> int:
        with torch.inference_mode():
            output = model.generate(torch.tensor([prompt], device=model.device),
                                    max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=0, streamer=clock)
        return output.shape[1] - len(prompt)

    generate(spec["warmup_prompt"], 4, None)
    prompts = spec["prompts"][:spec["hf_sequential_prompts"]]
    clocks = [TokenClock() for _ in prompts]
    start = time.perf_counter()
    lengths = [generate(prompt, output_len, clock) for prompt, clock in zip(prompts, clocks)]
    wall = time.perf_counter() - start
    _check_lengths(lengths, len(prompts), output_len)
    rates = [(len(c.times) - 1) / (c.times[-1] - c.times[0]) for c in clocks]
    return _throughput(len(prompts), sum(lengths), wall) | _single_stream(rates) | {
        "note": (f"requests run one at a time, so only the first {len(prompts)} of "
                 f"{len(spec['prompts'])} prompts ran; output tokens/s is sequential per-request "
                 "throughput over those. The single-stream decode is the median over those "
                 "requests of (tokens - 1) / (last token time - first token time)."),
    }


def _single_stream(rates: list[float]) -> Result:
    """Single-stream decode: the median of one-request-at-a-time runs (one run is noisy here)."""
    return {"single_stream_decode_tokens_per_s": statistics.median(rates),
            "single_stream_decode_runs": rates}


def run_hf_generate_batch(spec: Spec) -> Result:
    # Plain "sdpa" is generate_batch's paged path on CPU: transformers 5.24 strips the deprecated
    # "paged|" prefix of "paged|sdpa" at load, so both spellings run the same code.
    model = _load_hf_model(spec, attn_implementation="sdpa")
    output_len, prompts = spec["output_len"], spec["prompts"]
    # Size the KV cache for this workload: on CPU it would otherwise take 60% of the machine's RAM.
    page_size = 256
    pages_per_request = -(-(max(map(len, prompts)) + output_len) // page_size)
    batching = ContinuousBatchingConfig(
        **{PAGE_SIZE_FIELD: page_size}, num_blocks=len(prompts) * pages_per_request,
        max_batch_tokens=spec["hf_max_batch_tokens"],
        max_requests_per_batch=spec["hf_max_requests_per_batch"])
    # eos_token_id=-1 turns EOS off (None would fall back to the model's EOS).
    generation = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1)
    warmup = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1)
    model.generate_batch([spec["warmup_prompt"]], generation_config=warmup,
                         continuous_batching_config=batching)
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=generation,
                                   continuous_batching_config=batching)
    wall = time.perf_counter() - start
    lengths = [len(output.generated_tokens) for output in outputs.values()]
    _check_lengths(lengths, len(prompts), output_len)
    kv_tokens = batching.num_blocks * page_size
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
                          * model.dtype.itemsize)
    settings = {name: getattr(batching, name) for name in (
        PAGE_SIZE_FIELD, "num_blocks", "max_batch_tokens", "max_requests_per_batch",
        "allow_block_sharing", "default_compile_level")}
    return _throughput(len(prompts), sum(lengths), wall) | {
        "kv_capacity_tokens": kv_tokens, "kv_cache_bytes": kv_tokens * kv_bytes_per_token,
        "attn_implementation": "sdpa", "continuous_batching_config": settings,
    }


def run_tokenmill(spec: Spec) -> Result:
    llm = LLM(spec["model"], dtype=spec["dtype"], device=spec["device"],
              max_num_seqs=spec["max_num_seqs"], num_threads=spec["threads"],
              quantization=spec["quantization"])
    output_len, prompts = spec["output_len"], spec["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([spec["warmup_prompt"]], SamplingParams(temperature=0.0, max_tokens=4,
                                                         ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    lengths = [len(output.outputs[0].token_ids) for output in outputs]
    _check_lengths(lengths, len(prompts), output_len)
    # The prompts hf_generate runs one at a time, each alone again (their prefixes now cached).
    singles = [llm.generate([prompt], params, use_tqdm=False)[0].metrics
               for prompt in prompts[:spec["hf_sequential_prompts"]]]
    runner, config = llm.engine.runner, llm.engine.config
    return _throughput(len(prompts), sum(lengths), wall) | _single_stream(
        [(output_len - 1) / (m.last_token_time - m.first_token_time) for m in singles]) | {
        "kv_capacity_tokens": runner.kv_capacity_tokens, "kv_cache_bytes": runner.kv_cache_bytes,
        "engine_config": {"quantization": config.quantization,
                          "quantization_served": runner.quantization,
                          "max_num_seqs": config.max_num_seqs,
                          "max_num_batched_tokens": config.max_num_batched_tokens,
                          "block_size": config.block_size,
                          "enable_prefix_caching": config.enable_prefix_caching},
    }


def _load_hf_model(spec: Spec, attn_implementation: str) -> Any:
    folder, kwargs = hf_source(Path(spec["model_path"]))
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, spec["dtype"]), attn_implementation=attn_implementation,
        **kwargs)
    return model.to(spec["device"]).eval()


def _check_lengths(lengths: list[int], num_requests: int, output_len: int) -> None:
    """The benchmark means nothing unless every request made exactly output_len tokens."""
    if lengths != [output_len] * num_requests:
        raise RuntimeError(f"expected {num_requests} requests of {output_len} tokens each, "
                           f"got lengths {lengths}")


def _throughput(num_requests: int, output_tokens: int, wall: float) -> Result:
    return {"requests": num_requests, "output_tokens": output_tokens, "wall_s": wall,
            "output_tokens_per_s": output_tokens / wall}


# ---- llama.cpp's batched decode, the reference -------------------------------------------------

def run_llama_batched(spec: Spec) -> Result:
    """llama-batched-bench with all the prompts' sequences at once and with one: prompt and decode
    rates, and output tokens/s over the whole run as the engines count it."""
    prompts, output_len = spec["prompts"], spec["output_len"]
    prompt_len = round(statistics.mean(map(len, prompts)))
    batch = len(prompts)
    command = [spec["llama_batched_bench"], "-m", spec["model_path"],
               "-c", str(batch * (prompt_len + output_len)), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", f"1,{batch}",
               "--output-format", "jsonl"]
    if spec["threads"]:
        command += ["-t", str(spec["threads"])]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        return {"status": f"failed (exit {completed.returncode}): "
                          f"{completed.stderr.strip()[-300:]}", "command": command}
    entries = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    runs = {entry["pl"]: entry for entry in entries if entry.get("pl") in (1, batch)}
    together = runs[batch]
    return {"status": "ok", "command": command, "sequences": batch, "prompt_len": prompt_len,
            "output_len": output_len, "wall_s": together["t"],
            "output_tokens_per_s": batch * output_len / together["t"],
            "batched_decode_tokens_per_s": together["speed_tg"],
            "batched_prompt_tokens_per_s": together["speed_pp"],
            "single_stream_decode_tokens_per_s": runs[1]["speed_tg"],
            # the worker's only child: llama.cpp's own peak
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


RUNNERS = {"hf_generate": run_hf_generate, "hf_generate_batch": run_hf_generate_batch,
           "tokenmill": run_tokenmill, "llama_batched": run_llama_batched}


def worker(spec_path: Path, result_path: Path) -> None:
    transformers.logging.set_verbosity_error()  # the driver also sets TQDM_DISABLE=1 for us
    spec = json.loads(spec_path.read_text())
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    result = RUNNERS[spec["engine"]](spec)
    # ru_maxrss is in KiB on Linux: the peak of this process, which ran nothing but this engine
    # (llama.cpp's runner reports its own process's).
    result.setdefault("peak_rss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if spec["device"].startswith("cuda"):
        result["peak_gpu_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
    result["torch_threads"] = torch.get_num_threads()
    result_path.write_text(json.dumps(result))


# ---- the driver -------------------------------------------------------------------------------

def run_engine(engine: str, spec: Spec) -> Result:
    with tempfile.TemporaryDirectory(prefix="bench_engine.") as folder:
        spec_path, result_path = Path(folder) / "spec.json", Path(folder) / "result.json"
        spec_path.write_text(json.dumps(spec | {"engine": engine}))
        subprocess.run([sys.executable, __file__, "--worker", str(spec_path), str(result_path)],
                       check=True, env=os.environ | {"TQDM_DISABLE": "1"})
        return json.loads(result_path.read_text())


def llama_batched_reference(binary: Path | None, spec: Spec) -> Result:
    if binary is None:
        return {"status": f"not built (no bin/llama-batched-bench under {default_peers_dir()}; "
                          "bash scripts/build_peers.sh)"}
    if not spec["model_path"].endswith(".gguf") or spec["device"] != "cpu":
        return {"status": "skipped: llama.cpp runs the GGUF file on the CPU only here"}
    return run_engine("llama_batched", spec | {"llama_batched_bench": str(binary)})


def ratios(results: dict[str, Result]) -> dict[str, float | None]:
    def ratio(engine: str, metric: str) -> float | None:
        if "tokenmill" not in results or engine not in results:
            return None
        return results["tokenmill"][metric] / results[engine][metric]

    return {"tokenmill_over_hf_generate_batch_throughput":
                ratio("hf_generate_batch", "output_tokens_per_s"),
            "tokenmill_over_hf_generate_single_stream_decode":
                ratio("hf_generate", "single_stream_decode_tokens_per_s")}


MEDIAN_FIGURES = ("wall_s", "output_tokens_per_s", "single_stream_decode_tokens_per_s",
                  "peak_rss_mib", "peak_gpu_memory_mib",
                  "batched_decode_tokens_per_s", "batched_prompt_tokens_per_s")  # llama.cpp's


def median_runs(runs: list[Result]) -> Result:
    """One engine's (or llama.cpp's) runs as one result: the median of each figure that varies
    by run, the rest (requests, KV capacity, configuration) from the first run."""
    return runs[0] | {figure: statistics.median(run[figure] for run in runs)
                      for figure in MEDIAN_FIGURES if figure in runs[0]}


def median_ratios(rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    names = rounds[0]["ratios"]
    return {name: None if rounds[0]["ratios"][name] is None
            else statistics.median(r["ratios"][name] for r in rounds) for name in names}


def median_reference(runs: list[Result]) -> Result:
    """The rounds' llama-batched-bench runs as one: medians where every run succeeded."""
    failed = [run for run in runs if run["status"] != "ok"]
    return failed[0] if failed else median_runs(runs)


def print_table(report: dict[str, Any], title: str) -> None:
    print(f"\n== bench_engine, dtype {report['dtype']} (requested {report['dtype_requested']}), "
          f"{report['workload']['num_prompts']} prompts x {report['workload']['output_len']} "
          f"output tokens{title}")
    print(f"{'engine':<18}{'requests':>9}{'out tok':>9}{'wall s':>9}{'out tok/s':>11}"
          f"{'1-stream tok/s':>16}{'peak RSS MiB':>14}{'KV tokens':>11}")
    for engine, r in report["engines"].items():
        single = r.get("single_stream_decode_tokens_per_s")
        print(f"{engine:<18}{r['requests']:>9}{r['output_tokens']:>9}{r['wall_s']:>9.1f}"
              f"{r['output_tokens_per_s']:>11.1f}{'-' if single is None else f'{single:.1f}':>16}"
              f"{r['peak_rss_mib']:>14.0f}{r.get('kv_capacity_tokens', '-'):>11}")
    for name, value in report["ratios"].items():
        shown = "n/a" if value is None else f"{value:.2f}x"
        print(f"{name}: {shown} (target >= {TARGETS[name]:g}x)")
    llama = report["llama_batched_bench"]
    if llama["status"] != "ok":
        print(f"llama.cpp llama-batched-bench (reference): {llama['status']}")
        return
    print(f"llama.cpp llama-batched-bench (reference; {llama['sequences']} sequences of "
          f"{llama['prompt_len']} synthetic prompt tokens): {llama['output_tokens_per_s']:.1f} "
          f"output tok/s over {llama['wall_s']:.1f} s; decode "
          f"{llama['batched_decode_tokens_per_s']:.1f} tok/s batched, "
          f"{llama['single_stream_decode_tokens_per_s']:.1f} alone; "
          f"peak RSS {llama['peak_rss_mib']:.0f} MiB")
    tokenmill = report["engines"].get("tokenmill")
    if tokenmill:
        print(f"tokenmill output tok/s over llama.cpp's batched decode: "
              f"{tokenmill['output_tokens_per_s'] / llama['batched_decode_tokens_per_s']:.2f}x")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, .gguf or folder")
    parser.add_argument("--dtype", "--dtypes", dest="dtypes", default="auto",
                        help="float32, bfloat16 or auto (tokenmill's rule: bf16 where the CPU "
                             "has AVX-512 BF16 or AMX); a list such as float32,auto runs each")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N], for every engine")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-sequential-prompts", type=int, default=8,
                        help="hf_generate runs only the first K prompts (it is slow)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="tokenmill's max_num_seqs")
    parser.add_argument("--quantization", default="auto",
                        help="tokenmill's --quantization; auto, its default, serves the GGUF's "
                        "own blocks in bfloat16 (the float model's numbers), none the "
                        "de-quantized weights")
    parser.add_argument("--hf-max-batch-tokens", type=int, default=2048,
                        help="generate_batch's max_batch_tokens (per-step token budget)")
    parser.add_argument("--hf-max-requests-per-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every engine this many times, the order turning each round")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in every engine (default: torch's default)")
    parser.add_argument("--output-json", default="benchmarks/results/bench_engine-{dtype}.json",
                        help="where to write each dtype's report; {dtype} is the requested dtype")
    parser.add_argument("--llama-batched-bench", type=Path, default=None,
                        help="the llama-batched-bench binary (default: bin/ under "
                             "$TOKENMILL_PEERS_DIR or ~/.cache/tokenmill/peers)")
    parser.add_argument("--no-llama", action="store_true",
                        help="skip the llama.cpp reference")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(*args.worker)
        return
    llama_binary = args.llama_batched_bench or default_peers_dir() / "bin" / "llama-batched-bench"
    llama_binary = llama_binary if llama_binary.is_file() else None
    engines = args.engines.split(",")
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if len(dtypes) > 1 and "{dtype}" not in args.output_json:
        raise SystemExit("--output-json needs a {dtype} placeholder when several dtypes run")
    model_path = resolve_model_path(args.model)
    prompts, warmup_prompt = build_prompts(model_path, args.num_prompts)
    for requested in dtypes:
        dtype = str(EngineConfig(dtype=requested, device=args.device).torch_dtype()
                    ).removeprefix("torch.")
        spec = {"model": args.model, "model_path": str(model_path), "dtype": dtype,
                "device": args.device,
                "prompts": prompts, "warmup_prompt": warmup_prompt, "output_len": args.output_len,
                "hf_sequential_prompts": min(args.hf_sequential_prompts, len(prompts)),
                "max_num_seqs": args.max_num_seqs, "hf_max_batch_tokens": args.hf_max_batch_tokens,
                "hf_max_requests_per_batch": args.hf_max_requests_per_batch,
                "threads": args.threads, "quantization": args.quantization}
        rounds = []
        for index in range(args.rounds):
            order = engines[index % len(engines):] + engines[:index % len(engines)]
            results = {}
            for engine in order:  # one at a time, never in parallel: they would share the cores
                print(f"[bench_engine] {dtype}, round {index + 1}: running {engine}", flush=True)
                results[engine] = run_engine(engine, spec)
            llama = {"status": "skipped (--no-llama)"} if args.no_llama else \
                llama_batched_reference(llama_binary, spec)
            rounds.append({"round": index + 1, "order": order,
                           "engines": {engine: results[engine] for engine in engines},
                           "ratios": ratios(results), "llama_batched_bench": llama})
        report = {
            "benchmark": "bench_engine", "dtype_requested": requested, "dtype": dtype,
            "model": args.model, "model_path": str(model_path),
            "workload": {"num_prompts": len(prompts), "output_len": args.output_len,
                         "prompt_lengths": [len(p) for p in prompts],
                         "prompt_source": "disjoint token slices of pydoc_data.topics",
                         "ignore_eos": True, "greedy": True},
            "machine": machine_info(args.device) | {"threads_requested": args.threads},
            "git": git_commit(),
            "engines": {engine: median_runs([r["engines"][engine] for r in rounds])
                        for engine in engines},
            "ratios": median_ratios(rounds), "targets": TARGETS,
            "llama_batched_bench": median_reference([r["llama_batched_bench"] for r in rounds]),
            "rounds": rounds,
        }
        if args.rounds > 1:
            for r in rounds:
                print_table(report | r, f", round {r['round']}")
        print_table(report, ", medians of the rounds" if args.rounds > 1 else "")
        path = Path(args.output_json.format(dtype=requested))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
