"""End to end: one real `tokenmill serve` process on loopback, driven by the official `openai`
client, httpx and lm-eval. The server (conftest's `tokenmill_server`) starts once for the whole run,
also serves tests/test_bench.py, and must shut down gracefully with every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import os
import string
import subprocess
import sys

import httpx
import pytest

from tests.prompts import CHAT_QUESTIONS, SYSTEM_PROMPT
from tests.server_process import REPO_ROOT, ServerProcess

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tokenmill_server: ServerProcess) -> ServerProcess:
    return tokenmill_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)


def test_openai_client_streamed_equals_not_streamed(client):
    sampling = dict(model=MODEL, max_tokens=12, temperature=0.8, seed=1234)
    completion = client.completions.create(prompt="Once upon a time", **sampling)
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True, **sampling))
    text = completion.choices[0].text
    assert text and "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == completion.choices[0].finish_reason
    assert completion.usage.completion_tokens == 12 or completion.choices[0].finish_reason == "stop"

    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    chat = client.chat.completions.create(messages=messages, **sampling)
    stream = client.chat.completions.create(messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **sampling)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chat.choices[0].message.content and streamed == chat.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens


def test_32_concurrent_streaming_chats_run_batched(server):
    async def one_chat(client, question: str):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage

    async def watch_running(stop: asyncio.Event) -> float:
        most = 0.0
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                text = (await http.get(f"{server.base_url}/metrics")).text
                for line in text.splitlines():
                    if line.startswith("tokenmill:num_requests_running"):
                        most = max(most, float(line.rpartition(" ")[2]))
                await asyncio.sleep(0.05)
        return most

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                    timeout=300)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_running(stop))
        questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + f" (#{i})" for i in range(32)]
        results = await asyncio.gather(*(one_chat(client, q) for q in questions))
        stop.set()
        return questions, results, await watcher

    questions, results, most_running = asyncio.run(main())
    assert most_running > 1
    for question, (text, usage) in zip(questions, results):
        assert text
        assert usage.completion_tokens == 8
        tokens = httpx.post(f"{server.base_url}/tokenize", json={
            "messages": [{"role": "user", "content": question}]}, timeout=30).json()
        assert usage.prompt_tokens == tokens["count"]
        assert usage.total_tokens == usage.prompt_tokens + 8


def test_disconnect_aborts_and_frees_every_block(server):
    before = server.metrics().get('tokenmill:request_success_total{finished_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=120) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
    assert received  # the stream was running when the client left
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client giving up
        httpx.post(f"{server.base_url}/v1/completions",
                   json={**body, "stream": False}, timeout=3)
    metrics = server.wait_until_idle()
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0
    aborted = metrics['tokenmill:request_success_total{finished_reason="abort"}'] - before
    assert aborted == 2


def test_shared_system_prompt_hits_the_prefix_cache(client, server):
    hits_before = server.metrics().get("tokenmill:prefix_cache_hits_total", 0)
    usages = []
    for question in ("How do backups work?", "What are the support hours?"):
        chat = client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": question}])
        usages.append(chat.usage)
    assert usages[0].prompt_tokens > 200
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached >= 192
    hits = server.metrics()["tokenmill:prefix_cache_hits_total"] - hits_before
    assert hits == cached


def test_echo_logprobs_score_the_prompt(server):
    body = {"model": MODEL, "prompt": "The capital of France is Paris", "max_tokens": 1,
            "temperature": 0, "echo": True, "logprobs": 2}
    first = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    again = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    logprobs = first["choices"][0]["logprobs"]
    num_prompt = first["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + 1
    assert "".join(logprobs["tokens"]) == first["choices"][0]["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(v <= 0 for v in logprobs["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])
    # A repeat is scored in full, never from the prefix cache, and scores the same.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        logprobs["token_logprobs"][1:], abs=1e-4)

    plain = {**body, "max_tokens": 3, "logprobs": None}
    whole = httpx.post(f"{server.base_url}/v1/completions", json=plain,
                       timeout=120).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{server.base_url}/v1/completions",
                      json={**plain, "stream": True}, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert whole.startswith(body["prompt"]) and len(whole) > len(body["prompt"])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole


def test_parameters_n_prompts_and_chat_logprobs(client):
    batch = client.completions.create(model=MODEL, prompt=["Hello", "The sky is"], n=2,
                                      max_tokens=4, temperature=1.0, seed=3)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert 4 <= batch.usage.completion_tokens <= 16  # counted over every choice
    assert batch.usage.prompt_tokens == 1 + 3  # each prompt once, whatever n is
    chat = client.chat.completions.create(
        model=MODEL, max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "Count from 1 to 10."}],
        extra_body={"top_k": 40, "min_p": 0.01})
    content = chat.choices[0].logprobs.content
    assert content and all(len(entry.top_logprobs) == 2 for entry in content)


def test_stop_strings_end_the_text_before_them_streamed_or_not(client):
    """The unstopped answer contains the stop string, so the stopped one would too (and be
    longer) if `stop` were ignored."""
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    sampling = dict(model=MODEL, messages=messages, temperature=0, max_completion_tokens=40)
    text = client.chat.completions.create(**sampling).choices[0].message.content
    assert "5" in text, text
    expected = text[:text.index("5")]

    stopped = client.chat.completions.create(stop=["5"], **sampling).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == expected
    chunks = list(client.chat.completions.create(stop=["5"], stream=True, **sampling))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_tokenize_detokenize_models_health_version(server, client):
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_lm_eval_scores_a_loglikelihood_and_a_generation_task(server, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")
    from tokenmill.model.loader import cache_root
    tokenizer = cache_root() / MODEL / "tokenizer"
    output = tmp_path / "results"
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
               "--model_args", f"model={MODEL},base_url={server.base_url}/v1/completions,"
               f"tokenizer_backend=huggingface,tokenizer={tokenizer},max_retries=1",
               "--tasks", "tokenmill_capitals,tokenmill_arithmetic",
               "--include_path", "tests/lm_eval_tasks", "--output_path", str(output)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    [results_file] = output.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert results["tokenmill_capitals"]["acc,none"] >= 0.5  # SmolLM2 knows most capitals
    # lm-eval's score of the generation task is what the server's own greedy answers earn (one
    # of the four in fp32: "4" for 2 plus 2).
    expected = arithmetic_exact_match(server)
    assert expected > 0 and results["tokenmill_arithmetic"]["exact_match,none"] == \
        pytest.approx(expected)


def arithmetic_exact_match(server: ServerProcess) -> float:
    """The share of tests/lm_eval_tasks/arithmetic.jsonl the server answers exactly, asked as
    the task's YAML asks (greedy, up to 8 tokens, until a newline; case and punctuation
    ignored)."""
    rows = [json.loads(line) for line in
            (REPO_ROOT / "tests/lm_eval_tasks/arithmetic.jsonl").read_text().splitlines()]
    drop = str.maketrans("", "", string.punctuation)
    hits = 0
    for row in rows:
        body = {"model": MODEL, "prompt": f"Question: {row['question']}\nAnswer:",
                "max_tokens": 8, "temperature": 0, "stop": ["\n"]}
        text = httpx.post(f"{server.base_url}/v1/completions", json=body,
                          timeout=60).json()["choices"][0]["text"]
        hits += text.lower().translate(drop) == f" {row['answer']}".lower().translate(drop)
    return hits / len(rows)
