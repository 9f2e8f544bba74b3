"""End to end: keys, tenants and every error status, on one real `tokenmill serve` process.

The server has a keys file of two tenants, room for one running and one waiting request, and a
KV pool (1,024 tokens) smaller than the context (2,048), so each error case is real: no fault is
injected. After every error the server must still serve.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.prompts import SYSTEM_PROMPT
from tests.server_process import ServerProcess, start_server
from tokenmill.server.auth import ApiKeys, cache_salt

MODEL = "smollm2-135m-instruct"
NUM_KV_BLOCKS = 64
KEYS = {"alpha": "key-of-alpha", "beta": "key-of-beta"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    folder = tmp_path_factory.mktemp("guarded")
    keys_file = folder / "keys.txt"
    keys_file.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()))
    process = start_server(folder / "server.log", "--api-key", str(keys_file),
                           "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "2048",
                           "--max-num-seqs", "1", "--max-waiting-requests", "1")
    yield process
    log = process.stop()
    # uvicorn drains, then exits through the SIGTERM it caught, as a plain kill would.
    assert process.process.returncode in (0, -signal.SIGTERM), log
    assert f"shutdown: all {NUM_KV_BLOCKS} KV blocks free" in log, log


def post(server: ServerProcess, path: str, body: dict, tenant: str | None = "alpha",
         **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers,
                      timeout=kwargs.pop("timeout", 300), **kwargs)


def chat(question: str, **extra) -> dict:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": question}]}


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert all(word in error["message"] for word in words), error["message"]
    return error


def assert_still_serving(server: ServerProcess) -> None:
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                 "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_tenants_never_share_cached_prefixes(server):
    def cached(tenant: str, **extra) -> int:
        response = post(server, "/v1/chat/completions", chat("Hi", **extra), tenant=tenant)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alpha") == 0
    assert cached("beta") == 0  # the same prompt, another tenant: no hit
    assert cached("alpha", cache_salt="pretend-to-be-beta") > 0  # the client salt is ignored
    assert cached("beta") > 0


def test_missing_or_wrong_key_is_401(server):
    assert_error(post(server, "/v1/completions", {"prompt": "Hi"}, tenant=None), 401, "API key")
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat("Hi"),
                          headers={"Authorization": "Bearer wrong"})
    error = assert_error(response, 401, "API key")
    assert error["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # health needs no key
    assert_still_serving(server)


def test_unknown_model_is_404(server):
    error = assert_error(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}),
                         404, "gpt-4")
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert_still_serving(server)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature", ["temperature"]),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens", ["max_tokens"]),
    ("/v1/completions", {"prompt": "Hi", "top_logprobs": 2, "logprobs": 50}, "logprobs",
     ["logprobs"]),
    ("/v1/chat/completions", {"messages": []}, "messages", ["messages"]),
])
def test_invalid_parameters_are_400(server, path, body, param, words):
    error = assert_error(post(server, path, {"model": MODEL, **body}), 400, *words)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert_still_serving(server)


def test_prompt_plus_max_tokens_over_the_context_is_400_naming_both(server):
    prompt = "word " * 1500
    num_prompt = post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 600}
    error = assert_error(post(server, "/v1/completions", body), 400, "2048", str(num_prompt),
                         "600")
    assert error["code"] == "context_length_exceeded"
    assert_still_serving(server)


def test_an_engine_fault_on_one_request_is_500(server):
    # 1,500 tokens fit the 2,048-token context but not the 1,024-token KV pool: the engine
    # fails this request alone.
    body = {"model": MODEL, "prompt": "word " * 1500, "max_tokens": 4}
    assert_error(post(server, "/v1/completions", body), 500, "KV blocks")
    with httpx.stream("POST", f"{server.base_url}/v1/completions",
                      json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEYS['alpha']}"},
                      timeout=300) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert "KV blocks" in events[0] and events[-1] == "data: [DONE]"
    assert_still_serving(server)


def test_a_full_waiting_queue_is_503_with_retry_after(server):
    long = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS['alpha']}"}
    with httpx.Client(timeout=300, headers=headers) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", json=long) as running:
            lines = running.iter_lines()  # kept: closing this iterator would hang up the stream
            next(line for line in lines if line.startswith("data:"))
            # max_num_seqs is 1: this one waits, and fills the waiting queue.
            with http.stream("POST", f"{server.base_url}/v1/completions",
                             json=long) as waiting:
                assert waiting.status_code == 200
                refused = http.post(f"{server.base_url}/v1/completions",
                                    json={**long, "stream": False})
    error = assert_error(refused, 503, "waiting")
    assert refused.headers["Retry-After"] and error["type"] == "server_overloaded"
    server.wait_until_idle()  # the two streams just closed are aborted as their clients leave
    assert_still_serving(server)


def test_keys_file_and_single_key_parsing(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("k1 team-a\n\n# comment\nk2 team-b\n")
    keys = ApiKeys.parse(str(keys_file))
    assert keys.tenant("Bearer k2") == "team-b"
    single = ApiKeys.parse("just-one-key")
    assert single.tenant("Bearer just-one-key") is None
    assert cache_salt(None, "client-salt") == "client-salt"  # no tenants: the client decides
    assert cache_salt("team-a", "client-salt") == "tenant:team-a"
    keys_file.write_text("k1 team-a extra\n")
    with pytest.raises(ValueError, match="key tenant"):
        ApiKeys.parse(str(keys_file))
