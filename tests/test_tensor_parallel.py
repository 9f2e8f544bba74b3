"""Tensor parallelism: real worker processes joined by torch.distributed (gloo) on loopback.

Greedy output at TP=2 must equal TP=1 token for token (fp32) on tiny random-weight models whose
heads divide (KV heads split, KV heads replicated, Qwen2 biases), and the real SmolLM2 must give
the same output at TP=3 as alone. Workers start as `python -m tokenmill.distributed.worker`, so a
script with no main guard, or one piped to `python -`, starts them as a script file would. Workers
must never outlive the engine: not after a shutdown, not after Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file

from tests.prompts import CHAT_QUESTIONS
from tests.server_process import REPO_ROOT, free_port
from tokenmill import LLM, SamplingParams
from tokenmill.distributed.shard import TensorShard
from tokenmill.distributed.worker_group import WorkerGroup
from tokenmill.model.loader import LoadedModel
from tokenmill.model.model_config import ModelConfig

TINY_VOCAB, TINY_HIDDEN, TINY_FFN, TINY_LAYERS, TINY_HEAD_DIM = 512, 64, 128, 2, 16
# The tokenizer is SmolLM2's; its end tokens (ids 0 and 2) get zero logits, so greedy
# generation on random weights never stops early.
END_TOKEN_IDS = (0, 2)


def write_tiny_model(folder: Path, smollm: LoadedModel, architecture: str, num_heads: int,
                     num_kv_heads: int) -> Path:
    """A random-weight Llama or Qwen2 checkpoint folder (config.json, safetensors, tokenizer)."""
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    q_size, kv_size = num_heads * TINY_HEAD_DIM, num_kv_heads * TINY_HEAD_DIM
    lm_head = random(TINY_VOCAB, TINY_HIDDEN, scale=1.0)
    lm_head[list(END_TOKEN_IDS)] = 0
    weights = {"model.embed_tokens.weight": random(TINY_VOCAB, TINY_HIDDEN, scale=1.0),
               "model.norm.weight": 1 + random(TINY_HIDDEN), "lm_head.weight": lm_head}
    for layer in range(TINY_LAYERS):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "input_layernorm.weight": 1 + random(TINY_HIDDEN),
            prefix + "post_attention_layernorm.weight": 1 + random(TINY_HIDDEN),
            prefix + "self_attn.q_proj.weight": random(q_size, TINY_HIDDEN),
            prefix + "self_attn.k_proj.weight": random(kv_size, TINY_HIDDEN),
            prefix + "self_attn.v_proj.weight": random(kv_size, TINY_HIDDEN),
            prefix + "self_attn.o_proj.weight": random(TINY_HIDDEN, q_size),
            prefix + "mlp.gate_proj.weight": random(TINY_FFN, TINY_HIDDEN),
            prefix + "mlp.up_proj.weight": random(TINY_FFN, TINY_HIDDEN),
            prefix + "mlp.down_proj.weight": random(TINY_HIDDEN, TINY_FFN),
        }
        if architecture == "Qwen2ForCausalLM":
            for part, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                weights[f"{prefix}self_attn.{part}_proj.bias"] = random(size)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "architectures": [architecture], "vocab_size": TINY_VOCAB, "hidden_size": TINY_HIDDEN,
        "intermediate_size": TINY_FFN, "num_hidden_layers": TINY_LAYERS,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": TINY_HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    smollm.tokenizer.save_pretrained(folder)
    return folder


def tiny_prompts() -> list[list[int]]:
    """Varied lengths, two sharing 40 tokens (a prefix-cache hit), one chunked (> 64 tokens)."""
    generator = torch.Generator().manual_seed(1)

    def tokens(count: int) -> list[int]:
        return torch.randint(3, TINY_VOCAB, (count,), generator=generator).tolist()

    shared = tokens(40)
    return [tokens(5), shared + tokens(7), shared + tokens(3), tokens(150), tokens(1)]


def greedy_tokens(llm: LLM, prompts: list, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def stop_and_check_workers(llm: LLM) -> None:
    workers = llm.engine.runner.workers
    llm.engine.shutdown()
    assert workers is not None and workers.processes
    for process in workers.processes:
        assert not process.is_alive() and process.exitcode == 0, process


def test_shards_split_heads_and_replicate_scarce_kv_heads():
    def config(num_heads: int, num_kv_heads: int) -> ModelConfig:
        return ModelConfig("llama", 100, 576, 1536, 1, num_heads, num_kv_heads, 64, 1e-5, 1e4,
                           128, True, False)

    smollm2 = config(9, 3)
    assert [(TensorShard(r, 3).q_heads(smollm2), TensorShard(r, 3).kv_heads(smollm2))
            for r in range(3)] == [(range(0, 3), range(0, 1)), (range(3, 6), range(1, 2)),
                                   (range(6, 9), range(2, 3))]
    assert TensorShard(1, 3).local_config(smollm2).intermediate_size == 512
    # 8 query heads reading 2 KV heads over 4 ranks: each KV head lives on two ranks.
    grouped = config(8, 2)
    assert [TensorShard(r, 4).kv_heads(grouped) for r in range(4)] == [
        range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: the model has 9 attention "
                       r"heads and 3 KV heads"):
        TensorShard(0, 2).check(smollm2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        TensorShard(0, 4).check(config(8, 3))


@pytest.mark.parametrize("architecture,num_heads,num_kv_heads,kv_cache_dtype", [
    ("LlamaForCausalLM", 4, 2, "auto"),  # KV heads split
    ("Qwen2ForCausalLM", 4, 1, "auto"),  # one KV head replicated on both ranks; q/k/v biases split
    ("LlamaForCausalLM", 4, 2, "int8"),  # each rank calibrates its own heads' key smoothing
])
def test_tp2_greedy_equals_tp1_on_tiny_models(tmp_path, smollm, architecture, num_heads,
                                              num_kv_heads, kv_cache_dtype):
    folder = write_tiny_model(tmp_path / "tiny", smollm, architecture, num_heads, num_kv_heads)
    options = dict(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=8,
                   max_num_batched_tokens=64, debug_checks=True, kv_cache_dtype=kv_cache_dtype)
    prompts = tiny_prompts()
    expected = greedy_tokens(LLM(**options), prompts, max_tokens=24)
    parallel = LLM(**options, tensor_parallel_size=2)
    try:
        assert greedy_tokens(parallel, prompts, max_tokens=24) == expected
        # Again, now that the shared prefix is cached: hits, and decode batches of five.
        assert greedy_tokens(parallel, prompts, max_tokens=24) == expected
        assert parallel.engine.kv_cache.stats.hits > 0
    finally:
        stop_and_check_workers(parallel)


def test_smollm2_tp3_equals_tp1(make_llm, llm_fp32):
    messages = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:3]]
    params = SamplingParams(temperature=0, max_tokens=10)
    expected = [o.outputs[0].token_ids for o in llm_fp32.chat(messages, params, use_tqdm=False)]
    parallel = make_llm(tensor_parallel_size=3)
    try:
        # Three ranks of 3 query heads and 1 KV head each.
        assert parallel.engine.runner.model.layers[0].self_attn.num_kv_heads == 1
        outputs = parallel.chat(messages, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        stop_and_check_workers(parallel)


# A user's script as it is often written: no `if __name__ == "__main__":` guard. Under
# multiprocessing's spawn each worker would re-run it, and piped to `python -` it has no file.
UNGUARDED_SCRIPT = """
import json, sys
from tokenmill import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", num_kv_blocks=64, block_size=8,
          tensor_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


@pytest.mark.parametrize("how", ["script file", "piped to python -"])
def test_tp2_from_a_script_without_main_guard_equals_tp1(tmp_path, smollm, how):
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    prompts = tiny_prompts()
    expected = greedy_tokens(LLM(model=str(folder), dtype="float32", num_kv_blocks=64,
                                 block_size=8), prompts, max_tokens=12)
    script = tmp_path / "generate.py"
    script.write_text(UNGUARDED_SCRIPT)
    arguments = [str(folder), json.dumps(prompts)]
    command, stdin = ([sys.executable, str(script), *arguments], None) if how == "script file" \
        else ([sys.executable, "-", *arguments], UNGUARDED_SCRIPT)
    # From another folder, as a user's script runs: nothing of the repository on the path.
    result = subprocess.run(command, input=stdin, capture_output=True, text=True, cwd=tmp_path,
                            timeout=240)
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert json.loads(line[7:]) == expected
    assert result.stdout.count("TOKENS ") == 1  # no worker ran the script again


def test_a_worker_that_fails_while_starting_raises_with_its_last_log_lines(tmp_path, smollm,
                                                                          monkeypatch):
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    start = WorkerGroup.start.__func__

    def start_over_a_broken_file(cls, config):
        # Rank 0 has read the weights; rank 1 will read this. A new file replaces the old one,
        # whose pages rank 0 may still map.
        broken = folder / "broken.safetensors"
        broken.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
        os.replace(broken, folder / "model.safetensors")
        return start(cls, config)

    monkeypatch.setattr(WorkerGroup, "start", classmethod(start_over_a_broken_file))
    with pytest.raises(RuntimeError) as error:
        LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=8,
            tensor_parallel_size=2)
    message = str(error.value)
    assert message.startswith("tensor parallel: tokenmill-rank-1 exited with code 1 while "
                              "starting; its last log lines:\n"), message
    assert "Traceback" in message and "deserializ" in message, message


def test_heads_that_dont_divide_fail_at_start_up(make_llm):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: the model has 9 attention "
                       "heads"):
        make_llm(tensor_parallel_size=2)


def test_ranks_on_a_second_node_join_by_tcp_and_stop_with_the_engine(tmp_path, smollm):
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    address = f"127.0.0.1:{free_port()}"
    options = dict(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=8)
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", address]
    # Node 1 is its own command, as on another host: it runs rank 1 and serves nothing.
    node = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--model",
                             str(folder), "--dtype", "float32", "--num-kv-blocks", "64",
                             "--block-size", "8", "--node-rank", "1", *flags], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    expected = greedy_tokens(LLM(**options), tiny_prompts(), max_tokens=8)
    engine = LLM(**options, tensor_parallel_size=2, nnodes=2, dist_init_addr=address)
    assert engine.engine.runner.workers.processes == []  # node 0 holds rank 0 alone
    assert greedy_tokens(engine, tiny_prompts(), max_tokens=8) == expected
    engine.engine.shutdown()
    output, _ = node.communicate(timeout=60)
    assert node.returncode == 0 and "node 1: ranks [1] started" in output, output


def test_a_dead_worker_fails_requests_at_once_and_marks_the_engine_unhealthy(tmp_path, smollm):
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=8,
              tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert not llm.generate(tiny_prompts()[:2], params, use_tqdm=False)[0].error
    [worker] = llm.engine.runner.workers.processes
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=30)
    assert not worker.is_alive()
    for _ in range(2):  # the peer's loss, then the stopped group: an error, never a hang
        outputs = llm.generate(tiny_prompts()[:2], params, use_tqdm=False)
        assert all(o.error and o.error.startswith("engine error: ") for o in outputs)
        assert not llm.engine.healthy
    assert llm.engine.kv_cache.pool.num_free == llm.engine.kv_cache.pool.num_blocks
    llm.engine.shutdown()


def test_ctrl_c_stops_every_rank(tmp_path, smollm):
    folder = write_tiny_model(tmp_path / "tiny", smollm, "LlamaForCausalLM", 4, 2)
    log_path = tmp_path / "generate.log"
    command = [sys.executable, "-m", "tokenmill.cli", "generate", "a b c", "--no-chat",
               "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "512",
               "--tensor-parallel-size", "2", "--max-tokens", "3000", "--num-threads", "2"]
    with log_path.open("w") as log:
        # Its own process group (setsid), so the SIGINT below reaches its process group as a terminal's would.
        # SIGINT at its default: a shell runs background jobs (`pytest &`) with it ignored, and
        # a child inherits that, so Python would never raise KeyboardInterrupt there.
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while "tokenmill[rank 1]: weights:" not in log_path.read_text():  # the worker is ready
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)
    children = psutil.Process(process.pid).children(recursive=True)
    assert any("tokenmill.distributed.worker" in " ".join(c.cmdline()) for c in children), \
        log_path.read_text()
    ready = len(log_path.read_text())
    while len(log_path.read_text()) < ready + 200:  # text streaming: generating now
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=60) == 130, log_path.read_text()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], log_path.read_text()
