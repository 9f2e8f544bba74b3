"""The servers tokenmill is measured against, each started on loopback with the same model file:

- `tokenmill`: `tokenmill serve`;
- `hf-generate`: Hugging Face `generate` behind tokenmill.bench.hf_server, one request at a time
  (the "basic setup");
- `transformers-serve`: `transformers serve --continuous-batching` on the CPU, over the same
  weights saved once as a Hugging Face folder;
- `llama-server`: llama.cpp's server with `-np` parallel slots and continuous batching, built by
  scripts/build_peers.sh into the peers cache (never in CI).
A peer that cannot start raises ServerUnavailable saying why; the comparison reports it and goes
on. Peers run one after another, never at the same time.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.launch import ServerUnavailable, tokenmill_command
from tokenmill.model.loader import (DEFAULT_MODEL, cache_root, load_tokenizer,
                                     resolve_model_path)


def default_peers_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_PEERS_DIR") or cache_root() / "peers")


@dataclass(frozen=True)
class PeerSettings:
    model: str = DEFAULT_MODEL  # built-in name or .gguf path, the same file for every peer
    parallel: int = 16  # sequences a server is set up to run at once (llama-server -np)
    threads: int = 2
    hf_dtype: str = "bfloat16"  # the Hugging Face peers' dtype (tokenmill's auto is bf16 here)
    context_per_slot: int = 4096  # llama-server: context of each of its -np slots
    tokenmill_args: tuple[str, ...] = ()
    peers_dir: Path = field(default_factory=default_peers_dir)


@dataclass(frozen=True)
class PeerServer:
    """How to start a peer, and what its requests must carry."""
    command: list[str]
    request_model: str  # the `model` field of each request
    extra_body: dict  # request fields besides the workload
    env: dict[str, str] = field(default_factory=dict)


GREEDY_FULL_LENGTH = {"temperature": 0.0, "ignore_eos": True}


def _gguf(settings: PeerSettings) -> Path:
    path = resolve_model_path(settings.model)
    if not path.is_file():
        raise ServerUnavailable(f"peers need a GGUF file; {settings.model} is a folder")
    return path


def _tokenmill(settings: PeerSettings, port: int) -> PeerServer:
    return PeerServer(tokenmill_command(port, settings.model, "--num-threads",
                                        str(settings.threads), *settings.tokenmill_args),
                      settings.model, GREEDY_FULL_LENGTH)


def _hf_generate(settings: PeerSettings, port: int) -> PeerServer:
    return PeerServer([sys.executable, "-m", "tokenmill.bench.hf_server", "--model",
                       settings.model, "--port", str(port), "--dtype", settings.hf_dtype,
                       "--threads", str(settings.threads)], "hf-generate", GREEDY_FULL_LENGTH)


def _transformers_serve(settings: PeerSettings, port: int) -> PeerServer:
    executable = shutil.which("transformers")
    if executable is None:
        raise ServerUnavailable("the `transformers` command is not installed")
    folder = str(hf_folder(settings))
    # It answers 422 to fields it does not know (ignore_eos): a generation config whose EOS id
    # never occurs makes it produce max_tokens tokens all the same.
    no_eos = json.dumps({"do_sample": False, "eos_token_id": -1})
    # Its CPU default would give the KV cache 60% of the machine's memory: size it like
    # llama-server's (parallel x context_per_slot tokens) with tokenmill's per-step token budget.
    page = 256
    num_blocks = settings.parallel * settings.context_per_slot // page
    return PeerServer([executable, "serve", folder, "--continuous-batching", "--device", "cpu",
                       "--dtype", settings.hf_dtype, "--cb-block-size", str(page),
                       "--cb-num-blocks", str(num_blocks),
                       "--cb-max-batch-tokens", "2048", "--host", "127.0.0.1", "--port", str(port)],
                      folder, {"temperature": 0.0, "generation_config": no_eos},
                      env={"OMP_NUM_THREADS": str(settings.threads)})


def hf_folder(settings: PeerSettings) -> Path:
    """The model as a Hugging Face folder, made once into the peers cache: the weights
    de-quantized from the GGUF in fp32 (as transformers does when it reads a GGUF) and tokenmill's
    tokenizer, which carries the GGUF's chat template.

    `transformers serve <folder>:<file>.gguf` fails in transformers 5.24: the config it builds from
    a GGUF has no `architectures` (TypeError: 'NoneType' object is not subscriptable)."""
    gguf = _gguf(settings)
    folder = settings.peers_dir / "hf" / gguf.stem
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # save_pretrained refuses a model read from a GGUF ("not serializable"), so the tensors and
    # the config are written directly, as a plain float checkpoint.
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix="staging."))
    config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
    load_tokenizer(settings.model).save_pretrained(staging)
    os.replace(staging, folder)
    return folder


def _llama_server(settings: PeerSettings, port: int) -> PeerServer:
    binary = settings.peers_dir / "bin" / "llama-server"
    if not binary.exists():
        raise ServerUnavailable(f"llama-server is not built ({binary} is missing): run "
                                "scripts/build_peers.sh")
    return PeerServer([str(binary), "-m", str(_gguf(settings)), "--host", "127.0.0.1", "--port",
                       str(port), "-np", str(settings.parallel), "-c",
                       str(settings.parallel * settings.context_per_slot), "--cont-batching",
                       "-t", str(settings.threads), "-tb", str(settings.threads), "--metrics"],
                      settings.model, GREEDY_FULL_LENGTH)


PEERS: dict[str, Callable[[PeerSettings, int], PeerServer]] = {
    "tokenmill": _tokenmill,
    "hf-generate": _hf_generate,
    "transformers-serve": _transformers_serve,
    "llama-server": _llama_server,
}
