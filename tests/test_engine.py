"""Engine invariants on the real SmolLM2 weights in fp32, where greedy output must be identical.

Batch invariance, prefix caching, preemption, chunked prefill and block accounting each compare
against a plain reference run of the same engine.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.detokenizer import text_decoder
from tests.near_ties import assert_parts_only_at_near_ties
from tests.prompts import SYSTEM_PROMPT, varied_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_generate_returns_outputs_in_order_with_metrics(llm_fp32):
    prompts = ["Hello, my name is", "The capital of France is"]
    outputs = llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason in ("stop", "length")
        assert completion.text and completion.token_ids
        m = output.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_chat_answers_with_template(llm_fp32):
    [output] = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                             SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"  # ended on <|im_end|>


def test_batch_invariance(llm_fp32):
    prompts = varied_prompts(16)
    assert len({len(llm_fp32.engine.tokenize(p)) for p in prompts}) >= 8
    batched = token_ids(llm_fp32.generate(prompts, GREEDY))
    alone = [token_ids(llm_fp32.generate([p], GREEDY))[0] for p in prompts]
    assert batched == alone


def test_prefix_caching_hits_and_keeps_output(make_llm):
    questions = ["How do backups work?", "What are the support hours?",
                 "How is storage billed?", "Which instance sizes exist?"]
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = token_ids(make_llm(enable_prefix_caching=False).chat(conversations, params))

    llm = make_llm()
    first = llm.chat(conversations[:1], params)
    assert first[0].num_cached_tokens == 0
    assert len(first[0].prompt_token_ids) > 200
    stats_before = llm.engine.stats()
    second = llm.chat(conversations, params)
    stats_after = llm.engine.stats()
    assert token_ids(first + second[1:]) == reference[:1] + reference[1:]
    assert token_ids(second) == reference
    assert all(o.num_cached_tokens >= 192 for o in second)
    hits = stats_after.prefix_cache_hits - stats_before.prefix_cache_hits
    assert hits > 0
    computed = stats_after.prompt_tokens_total - stats_before.prompt_tokens_total
    assert computed < sum(len(o.prompt_token_ids) for o in second) - hits + 1

    salted = llm.chat(conversations[:1], params, cache_salt="another-tenant")
    assert salted[0].num_cached_tokens == 0
    assert token_ids(salted) == reference[:1]

    assert llm.reset_prefix_cache()
    after_reset = llm.chat(conversations[:1], params)
    assert after_reset[0].num_cached_tokens == 0
    assert token_ids(after_reset) == reference[:1]


def test_preemption_keeps_output(make_llm):
    prompts = varied_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = token_ids(make_llm().generate(prompts, params))
    small = make_llm(num_kv_blocks=24, block_size=16)
    outputs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions >= 1
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert token_ids(outputs) == reference
    assert small.engine.stats().num_kv_blocks_used == 0


def test_chunked_prefill_matches_unlimited_budget(make_llm):
    prompt = " ".join(f"item {i}: the value is {i * 7 % 13}." for i in range(120))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    unlimited = make_llm(max_num_batched_tokens=4096)
    assert len(unlimited.engine.tokenize(prompt)) > 1000
    reference = token_ids(unlimited.generate([prompt], params))
    chunked = make_llm(max_num_batched_tokens=64)
    assert token_ids(chunked.generate([prompt, "Hello there"], params))[0] == reference[0]


def test_aborts_return_every_block(make_llm):
    llm = make_llm(num_kv_blocks=256)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(varied_prompts(10)):
        engine.add_request(f"req{i}", prompt, params)
    for _ in range(6):
        engine.step()
    for i in range(0, 10, 2):
        engine.abort_request(f"req{i}")
    assert engine.abort_request("req0") is None  # aborting twice is harmless
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    engine.kv_cache.check_invariants([])


def test_seeded_sampling_is_reproducible_and_topk1_is_greedy(llm_fp32):
    prompts = varied_prompts(4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    first = token_ids(llm_fp32.generate(prompts, seeded))
    # The same seed in a different batch (with an unseeded neighbour) draws the same tokens.
    mixed = llm_fp32.generate([prompts[0], "noise prompt"],
                              [seeded, SamplingParams(temperature=1.0, max_tokens=16)])
    assert token_ids(mixed)[0] == first[0]
    assert token_ids(llm_fp32.generate(prompts, seeded)) == first
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert token_ids(llm_fp32.generate(prompts, top1)) == token_ids(
        llm_fp32.generate(prompts, greedy))


def test_sampled_first_tokens_follow_the_models_probabilities(llm_fp32):
    """400 seeded draws at temperature 1 take each of the five likeliest first tokens about as
    often as its probability says. A request decoded greedily would always take the top token;
    one sampled at another temperature would take it too often or too rarely."""
    prompt = "My favourite animal is the"
    scoring = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    [scored] = llm_fp32.generate([prompt], scoring, use_tqdm=False)
    probs = {token: math.exp(logprob) for token, logprob in scored.outputs[0].logprobs[0].items()}
    assert max(probs.values()) < 0.6  # else greedy and sampled draws are hard to tell apart
    draws = 400
    params = [SamplingParams(temperature=1.0, max_tokens=1, seed=seed) for seed in range(draws)]
    drawn = [o.outputs[0].token_ids[0]
             for o in llm_fp32.generate([prompt] * draws, params, use_tqdm=False)]
    for token, p in probs.items():
        share = drawn.count(token) / draws
        assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / draws) + 1 / draws, (token, share, p)


def test_sampling_n_and_logprobs(llm_fp32):
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=8, logprobs=2)
    [output] = llm_fp32.generate(["Tell me a story:"], params)
    assert len(output.outputs) == 3
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and all(v <= 0.0 for v in entry.values())


def test_stop_strings_cut_text_and_set_finish_reason(llm_fp32):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    [full] = llm_fp32.generate(["Count: 1, 2, 3, 4,"], greedy)
    text = full.outputs[0].text
    stop = text[6:9]
    assert stop.strip()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    [cut] = llm_fp32.generate(["Count: 1, 2, 3, 4,"], params)
    completion = cut.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[:text.index(stop)]


def test_the_text_decoder_gives_the_tokenizers_text(smollm):
    """The detokenizer's decode (the tokenizer's Rust backend, where that is all decode does)
    gives tokenizer.decode's text: special tokens dropped, a split character as U+FFFD."""
    tokenizer = smollm.tokenizer
    decode = text_decoder(tokenizer)
    ids = tokenizer.encode("Héllo wörld — 東京 🚀, <|im_end|> done", add_special_tokens=False)
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for window in [ids, [special, *ids, special], *(ids[:n] for n in range(1, len(ids)))]:
        assert decode(window) == tokenizer.decode(window, skip_special_tokens=True)
    assert any(decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))


def test_stop_token_ids(llm_fp32):
    [full] = llm_fp32.generate(["Count: 1, 2, 3, 4,"], GREEDY)
    tokens = full.outputs[0].token_ids
    position = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[position]])
    [cut] = llm_fp32.generate(["Count: 1, 2, 3, 4,"], params)
    completion = cut.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == tokens[position]
    assert completion.token_ids == tokens[:position + 1]


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "prompt is empty"),
    ("word " * 300, SamplingParams(), "max_model_len=256"),
    ([10**7], SamplingParams(), "outside the vocabulary"),
])
def test_bad_input_raises_and_engine_stays_usable(make_llm, prompt, params, message):
    llm = make_llm(max_model_len=256)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], params)
    assert not llm.engine.has_unfinished_requests()
    [ok] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))
    assert len(ok.outputs[0].token_ids) == 4


def test_bad_sampling_params_name_the_parameter():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_final_only_requests_give_one_output_when_they_finish(llm_fp32):
    """A cumulative request has an output every step it advances, a final_only one only the
    finished one, with the same tokens and text; LLM.generate asks for final_only."""
    engine = llm_fp32.engine
    for kind in ("cumulative", "final_only"):
        engine.add_request(kind, "The capital of France is",
                           SamplingParams(temperature=0.0, max_tokens=6, output_kind=kind))
    seen: dict[str, list] = {"cumulative": [], "final_only": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["cumulative"]) == 6 and not any(o.finished for o in seen["cumulative"][:-1])
    [final] = seen["final_only"]
    assert final.finished
    assert final.outputs[0].token_ids == seen["cumulative"][-1].outputs[0].token_ids
    assert final.outputs[0].text == seen["cumulative"][-1].outputs[0].text
    [offline] = llm_fp32.generate(["The capital of France is"],
                                  SamplingParams(temperature=0.0, max_tokens=6))
    assert offline.outputs[0].token_ids == final.outputs[0].token_ids


def test_unknown_model_name_is_a_clear_error():
    from tokenmill import LLM
    from tokenmill.model.loader import ModelNotFoundError
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        LLM(model="no-such-model")


def test_max_model_len_caps_generation(make_llm):
    llm = make_llm(max_model_len=64)
    prompt_ids = list(range(100, 150))
    [output] = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=100,
                                                         ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 64 - 50
    assert output.outputs[0].finish_reason == "length"


def test_prompt_logprobs_match_a_full_forward(make_llm, hf_smollm):
    """Chunked prefill and a repeated prompt (no cache hit allowed) score every prompt token."""
    import torch
    llm = make_llm(max_num_batched_tokens=32)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    token_ids = llm.engine.tokenize(prompt)
    assert len(token_ids) > 64  # several chunks of 32
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    first, again = llm.generate([prompt], params) + llm.generate([prompt], params)
    with torch.inference_mode():
        reference = hf_smollm(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
    for output in (first, again):
        entries = output.prompt_logprobs
        assert len(entries) == len(token_ids) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            expected = reference[position - 1]
            assert entry[token_ids[position]] == pytest.approx(
                expected[token_ids[position]].item(), abs=2e-3)
            top_ids = expected.topk(2).indices.tolist()
            assert set(top_ids) <= set(entry) and len(entry) <= 3
    assert again.num_cached_tokens == 0


def test_requests_arriving_with_a_shared_prefix_wait_for_the_one_computing_it(make_llm):
    questions = ["How do backups work?", "What are the support hours?",
                 "How is storage billed?", "Which instance sizes exist?"]
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = token_ids(make_llm(enable_prefix_caching=False).chat(conversations, params))
    llm = make_llm()
    outputs = llm.chat(conversations, params)  # all four arrive together, in one step's budget
    assert token_ids(outputs) == reference
    assert outputs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 192 for o in outputs[1:])  # computed once, not four times
    assert llm.engine.stats().prompt_tokens_total == sum(
        len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs)


def test_the_near_tie_check_catches_short_output_and_a_wrong_turn_after_a_tie(llm_fp32):
    """tests/near_ties.py against runs made wrong by hand: a short or empty output, and one that
    parts at a real tie (its two top tokens forced equal) and then takes a token the model would
    not (the second best at every later position)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    [reference] = llm_fp32.generate(["Once upon a time"], params, use_tqdm=False)
    completion = reference.outputs[0]

    def run(token_ids: list[int], logprobs: list[dict[int, float]]):
        return dataclasses.replace(reference, outputs=[dataclasses.replace(
            completion, token_ids=token_ids, logprobs=logprobs)])

    assert_parts_only_at_near_ties([reference], [reference], llm_fp32)
    for short in (completion.token_ids[:-1], []):
        with pytest.raises(AssertionError):
            assert_parts_only_at_near_ties([run(short, completion.logprobs[:len(short)])],
                                           [reference], llm_fp32)
    second_best = [sorted(entry, key=entry.get)[-2] for entry in completion.logprobs]
    tied = [dict.fromkeys(entry, max(entry.values())) for entry in completion.logprobs]
    wrong = completion.token_ids[:3] + second_best[3:]
    with pytest.raises(AssertionError):
        assert_parts_only_at_near_ties([run(wrong, tied)], [reference], llm_fp32)
