"""Runs `tokenmill eval`: each configuration over the same weights and inputs, one table, a gate.

The reference runs first: its perplexity is the baseline of every "change", and its greedy
continuations are what agreement compares with (its own row shows the method's noise floor: the
same tokens scored by prefill instead of decode). Configurations run one after another, each in
its own engine over one copy of the weights read from disk, and are freed before the next.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.eval.agreement import (PROMPTS, Continuation, greedy_agreement,
                                      reference_continuations)
from tokenmill.eval.configs import EvalConfig
from tokenmill.eval.perplexity import documentation_tokens, perplexity, slice_description
from tokenmill.eval.questions import Question, accuracy, load_questions
from tokenmill.model.loader import LoadedModel, load_model


@dataclass(frozen=True, slots=True)
class EvalOptions:
    num_tokens: int = 4096  # perplexity slice
    window: int = 1024  # tokens scored as one sequence
    max_questions: int | None = None  # None: the whole question set
    agreement_prompts: int = 12
    agreement_tokens: int = 48
    decode_tokens: int = 64  # single-stream decode timed for tokens/s

    def __post_init__(self) -> None:
        minimums = {"num_tokens": 2, "window": 2, "agreement_prompts": 1, "agreement_tokens": 1,
                    "decode_tokens": 2}
        for name, minimum in minimums.items():
            if getattr(self, name) < minimum:
                raise ValueError(f"invalid eval option {name}={getattr(self, name)}: must be "
                                 f">= {minimum}")
        if self.agreement_prompts > len(PROMPTS):
            raise ValueError(f"invalid eval option agreement_prompts={self.agreement_prompts}: "
                             f"the prompt set has {len(PROMPTS)}")


@dataclass(slots=True)
class ConfigResult:
    name: str
    quant_group_size: int | None  # inputs per int4 scale as served (auto resolved); None: not int4
    model_bytes: int
    kv_bytes_per_token: float
    perplexity: float
    perplexity_change: float  # percent against the reference
    agreement: float  # share of positions, 0..1
    accuracy: float  # share of questions, 0..1
    decode_tokens_per_s: float


@dataclass(slots=True)
class EvalReport:
    model: str
    options: EvalOptions
    reference: str
    results: list[ConfigResult]
    perplexity_text: str = ""  # slice_description of the tokens scored

    def table(self) -> str:
        header = ("configuration", "int4 group", "model MiB", "KV B/token", "perplexity", "change",
                  "agreement", "accuracy", "decode tok/s")
        rows = [header] + [(
            r.name + (" (reference)" if r.name == self.reference else ""),
            str(r.quant_group_size or "-"), f"{r.model_bytes / 2**20:.1f}", f"{r.kv_bytes_per_token:.0f}",
            f"{r.perplexity:.3f}", f"{r.perplexity_change:+.2f}%", f"{100 * r.agreement:.1f}%",
            f"{100 * r.accuracy:.1f}%", f"{r.decode_tokens_per_s:.1f}") for r in self.results]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
        return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])

    def floor_breaches(self, max_ppl_increase: float) -> list[str]:
        """One line for each configuration whose perplexity rose by more than the limit (%)."""
        return [f"{r.name}: perplexity {r.perplexity_change:+.2f}% > +{max_ppl_increase}%"
                for r in self.results if r.perplexity_change > max_ppl_increase]

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "reference": self.reference,
                "options": dataclasses.asdict(self.options),
                "perplexity_text": self.perplexity_text,
                "results": [dataclasses.asdict(r) for r in self.results]}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What every configuration is measured on; fixed by the reference run."""
    perplexity_tokens: list[int]
    continuations: list[Continuation]
    questions: list[Question]


def run_eval(base: EngineConfig, reference: EvalConfig, configs: list[EvalConfig],
             options: EvalOptions, loaded: LoadedModel | None = None) -> EvalReport:
    """`loaded`: weights already read (float32), shared by every configuration's engine."""
    loaded = loaded or load_model(base.model, torch.float32)
    ordered = [reference] + [c for c in configs if c.name != reference.name]
    # The inputs come from an engine of their own: generating the continuations leaves their
    # blocks in its prefix cache, and a bf16 step over cached blocks rounds unlike one that
    # computes them, so the reference is measured on a fresh engine as every configuration is
    # (SmolLM2's accuracy had read 38.3% for the reference and 40.0% for gguf, whose numbers
    # are the reference's own).
    llm = LLM.from_engine(LLMEngine(reference.engine_config(base), loaded))
    inputs = _Inputs(documentation_tokens(llm.engine.tokenize, options.num_tokens),
                     reference_continuations(llm, options.agreement_prompts,
                                             options.agreement_tokens),
                     load_questions(options.max_questions))
    del llm
    results: list[ConfigResult] = []
    for config in ordered:
        llm = LLM.from_engine(LLMEngine(config.engine_config(base), loaded))
        results.append(_measure(llm, config.name, inputs, options,
                                results[0].perplexity if results else None))
        del llm
        gc.collect()
    return EvalReport(base.model, options, reference.name, results,
                      slice_description(inputs.perplexity_tokens))


def _measure(llm: LLM, name: str, inputs: _Inputs, options: EvalOptions,
             reference_perplexity: float | None) -> ConfigResult:
    runner = llm.engine.runner
    ppl = perplexity(llm, inputs.perplexity_tokens, options.window)
    baseline = reference_perplexity or ppl
    return ConfigResult(
        name=name, quant_group_size=runner.quant_group_size, model_bytes=runner.model_bytes,
        kv_bytes_per_token=runner.kv_cache_bytes / runner.kv_capacity_tokens,
        perplexity=ppl, perplexity_change=100 * (ppl / baseline - 1),
        agreement=greedy_agreement(llm, inputs.continuations),
        accuracy=accuracy(llm, inputs.questions),
        decode_tokens_per_s=_decode_speed(llm, inputs.perplexity_tokens[:32],
                                          options.decode_tokens))


def _decode_speed(llm: LLM, prompt: list[int], num_tokens: int) -> float:
    """Single-stream decode: tokens after the first, over the time since the first."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    metrics = output.metrics
    return (num_tokens - 1) / (metrics.last_token_time - metrics.first_token_time)
