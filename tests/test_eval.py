"""`tokenmill eval` on SmolLM2 over small slices: the table, the figures' sanity, and the gate."""

from __future__ import annotations

import math
import re

import pytest

from tokenmill import EngineConfig
from tokenmill.cli import main
from tokenmill.eval.configs import parse_config, parse_configs
from tokenmill.eval.questions import Question, is_correct, load_questions, normalise
from tokenmill.eval import report as report_module
from tokenmill.eval.report import ConfigResult, EvalOptions, EvalReport, run_eval
from tokenmill.model.loader import DEFAULT_MODEL

SMALL = dict(num_tokens=256, window=128, max_questions=6, agreement_prompts=2,
             agreement_tokens=12, decode_tokens=8)


def test_configuration_names() -> None:
    assert parse_config("int8+kv-int8").overrides == {"quantization": "int8",
                                                      "kv_cache_dtype": "int8"}
    assert parse_config("int4-g32+fp32").overrides == {"quantization": "int4",
                                                       "quant_group_size": 32,
                                                       "dtype": "float32"}
    assert [c.name for c in parse_configs("none, int4,gguf")] == ["none", "int4", "gguf"]
    with pytest.raises(ValueError, match="unknown part 'int3'"):
        parse_config("int8+int3")


def test_question_set_and_normalisation() -> None:
    questions = load_questions()
    assert len(questions) >= 50
    assert {q.kind for q in questions} == {"fact", "arithmetic", "extraction"}
    assert {q.kind for q in load_questions(6)} == {"fact", "arithmetic", "extraction"}
    assert normalise(" The  Paris. ") == "paris" and normalise("$12") == "12"
    question = Question("fact", "?", ("William Shakespeare", "Shakespeare"))
    assert is_correct("shakespeare!", question)
    assert is_correct("The author was William Shakespeare.\nMore.", question)
    assert not is_correct("Shakespeare wrote it.", question)
    assert is_correct("14 + 28 = 42", Question("arithmetic", "?", ("42",)))
    assert not is_correct("The answer is 42 or 43", Question("arithmetic", "?", ("42",)))


def test_every_configuration_is_measured_on_a_fresh_engine(smollm, monkeypatch) -> None:
    """The reference's engine made the inputs (its greedy continuations) too; its measurement
    must not start from the prefix cache they left, or its bf16 figures differ from an
    identical configuration's."""
    measure, queries = report_module._measure, []

    def spy(llm, *args, **kwargs):
        queries.append(llm.engine.stats().prefix_cache_queries)
        return measure(llm, *args, **kwargs)

    monkeypatch.setattr(report_module, "_measure", spy)
    base = EngineConfig(model=DEFAULT_MODEL, dtype="bfloat16", num_kv_blocks=512)
    report = run_eval(base, parse_config("none"), parse_configs("bf16"), EvalOptions(**SMALL),
                      smollm)
    assert queries == [0, 0]
    reference, same = report.results
    assert (same.perplexity, same.agreement, same.accuracy) == \
        (reference.perplexity, reference.agreement, reference.accuracy)


def test_eval_table_on_smollm2(smollm) -> None:
    base = EngineConfig(model=DEFAULT_MODEL, dtype="bfloat16", num_kv_blocks=512)
    report = run_eval(base, parse_config("none"), parse_configs("int8,kv-int8"),
                      EvalOptions(**SMALL), smollm)
    names = [r.name for r in report.results]
    assert names == ["none", "int8", "kv-int8"]
    reference, int8, kv_int8 = report.results
    assert reference.perplexity_change == 0.0 and math.isfinite(reference.perplexity)
    assert 1 < reference.perplexity < 100  # the instruct model on Python's own docs
    for result in (int8, kv_int8):
        assert abs(result.perplexity_change) < 5
        assert result.agreement > 0.8
        # 6 questions: within two answers of the reference's score.
        assert abs(result.accuracy - reference.accuracy) <= 2 / 6 + 1e-9
        # Any CPU decodes SmolLM2 faster than a token a second; a time read in ms would not.
        assert result.decode_tokens_per_s > 1
    assert reference.accuracy >= 1 / 6 and reference.decode_tokens_per_s > 1
    assert int8.model_bytes < 0.6 * reference.model_bytes
    assert kv_int8.kv_bytes_per_token < 0.6 * reference.kv_bytes_per_token
    table = report.table().splitlines()
    assert "perplexity" in table[0] and "decode tok/s" in table[0]
    assert table[2].startswith("none (reference)") and len(table) == 5
    assert report.perplexity_text.startswith("pydoc_data.topics of Python 3.")
    assert f", {SMALL['num_tokens']} tokens, sha256 " in report.perplexity_text
    assert report.floor_breaches(5.0) == []


def test_floor_breaches_name_each_configuration() -> None:
    def result(name: str, change: float) -> ConfigResult:
        return ConfigResult(name, None, 1, 1.0, 10.0, change, 1.0, 1.0, 1.0)

    report = EvalReport("m", EvalOptions(), "none",
                        [result("none", 0.0), result("int8", 0.5), result("int4", 6.5)])
    assert report.floor_breaches(6.0) == ["int4: perplexity +6.50% > +6.0%"]
    assert report.floor_breaches(7.0) == []


def test_gate_exits_non_zero_when_the_floor_is_broken(capsys) -> None:
    # rtn: GPTQ's calibration at load would add a minute and prove nothing about the gate.
    args = ["eval", "--configs", "int4", "--max-ppl-increase", "0", "--num-kv-blocks", "256",
            "--quant-method", "rtn", *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "none (reference)" in captured.out
    # auto's group size, resolved: 64 over SmolLM2's 4-bit file.
    assert re.search(r"^int4 +64 ", captured.out, re.MULTILINE), captured.out
    assert "quality floor broken: int4: perplexity +" in captured.err


def test_bad_eval_options_are_one_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--configs", "int9"])
    assert exit_info.value.code == 2
    assert "unknown part 'int9'" in capsys.readouterr().err
