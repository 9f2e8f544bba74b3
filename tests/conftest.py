"""Shared fixtures: the real SmolLM2 weights are read from disk once per test run."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
import torch

from tests.server_process import ServerProcess, start_server

from tokenmill import LLM, EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.kernels import cpu_has_amx, cpu_kernels
from tokenmill.model.layers import packs_bf16
from tokenmill.model.loader import DEFAULT_MODEL, LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model(DEFAULT_MODEL, torch.float32)


@pytest.fixture(scope="session")
def make_llm(smollm: LoadedModel) -> Callable[..., LLM]:
    """An LLM over the shared SmolLM2 weights; engine options as keyword arguments."""

    def make(**options: object) -> LLM:
        options.setdefault("dtype", "float32")
        options.setdefault("num_kv_blocks", 2048)
        options.setdefault("debug_checks", True)
        # GPTQ calibrates SmolLM2 for about a minute at load; its tests (test_gptq.py) use a
        # tiny model, and the engine tests here quantize int4 by round-to-nearest.
        options.setdefault("quant_method", "rtn")
        # The float model unless a test names a format: quantization="auto" would serve the
        # GGUF's own blocks in bfloat16 (the same numbers; tests/test_quant.py checks it).
        options.setdefault("quantization", "none")
        config = EngineConfig.from_kwargs(model=DEFAULT_MODEL, **options)
        return LLM.from_engine(LLMEngine(config, smollm))

    return make


@pytest.fixture(scope="session")
def llm_fp32(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm()


@pytest.fixture(scope="session")
def hf_smollm(smollm: LoadedModel):
    """The same GGUF loaded by Hugging Face transformers, in fp32: the reference model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm.path.parent, gguf_file=smollm.path.name, dtype=torch.float32)
    return model.eval()


SERVER_KV_BLOCKS = 512


@pytest.fixture(scope="session")
def tokenmill_server(tmp_path_factory) -> ServerProcess:
    """One real `tokenmill serve` (fp32, 512 KV blocks) for the server and benchmark tests, started
    once; at the end it must shut down gracefully with every KV block free."""
    process = start_server(tmp_path_factory.mktemp("server") / "server.log",
                           "--num-kv-blocks", str(SERVER_KV_BLOCKS), "--max-num-seqs", "64")
    yield process
    log = process.stop()
    # uvicorn drains, then exits through the SIGTERM it caught, as a plain kill would.
    assert process.process.returncode in (0, -signal.SIGTERM), log
    assert f"shutdown: all {SERVER_KV_BLOCKS} KV blocks free" in log, log


def untested_paths() -> list[str]:
    """The kernel paths this machine can't run, so a green run here says nothing of them."""
    kernels = cpu_kernels()
    if kernels is None:
        return ["every C++ kernel (tokenmill/kernels did not build: no compiler?)"]
    missing = []
    if not cpu_has_amx():
        missing.append("AMX tiles (kernels/linear_amx.cpp; the AMX branches of "
                       "paged_attention.cpp and linear_quant.cpp)")
    if not kernels.linear_bf16_available():
        missing.append("AVX-512 BF16 (kernels/linear_bf16.cpp, tokenmill's int8/int4 products "
                       "in linear_quant.cpp, the bfloat16 decode stack and tiled prefill)")
    if not packs_bf16(torch.empty(4, 4, dtype=torch.bfloat16)):
        missing.append("oneDNN's packed bfloat16 product (model/layers.py)")
    if not torch.cuda.is_available():
        missing.append("CUDA (tests/test_cuda.py)")
    return missing


def pytest_terminal_summary(terminalreporter) -> None:
    missing = untested_paths()
    if missing:
        terminalreporter.write_line("not tested on this machine: " + "; ".join(missing),
                                    yellow=True, bold=True)
