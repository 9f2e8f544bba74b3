"""Calibration data for GPTQ, and the pass that runs it through a model one decoder layer at a time.

The data is the model's own writing: its sampled answers (seed fixed) to a fixed set of chat
prompts of many kinds (prose, code, SQL, arithmetic, lists, a letter, a dialogue), plus the prose
and code of `CALIBRATION_TEXT`. Generations follow the distribution the model serves, over every
kind of text it is asked for, and need no corpus beside the model. Never the perplexity text
(`pydoc_data.topics`, tokenmill/eval/perplexity.py): the evaluation would then measure its own
calibration. Bump `CALIBRATION_VERSION` whenever the data or the way it is made changes: it keys
the cache of quantized weights (tokenmill/quant/cache.py).

The answers are sampled in float32 whatever dtype the model serves in. In bfloat16, a kernel that
rounds one logit differently draws other tokens from there on and GPTQ finds other codes:
SmolLM2's int4 g128 (lm_head unrotated) read +14.10% and +16.98% from two commits' samples.
float32's rounding differences move a draw almost never.
"""

from __future__ import annotations

import torch

from tokenmill.model.attention import (AttentionMetadata, cache_slot, decode_kernel_available,
                                       padding_mask, prefill_chunk)
from tokenmill.model.kv_smoothing import CALIBRATION_TEXT
from tokenmill.model.llama import DecoderLayer, LlamaForCausalLM
from tokenmill.model.loader import LoadedModel

# 2: each layer's Hessian pass no longer adds into the stream it reads; 3: answers sampled in float32
CALIBRATION_VERSION = 3
CALIBRATION_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that parses a CSV file and returns the average of each column.",
    "Explain how vaccines train the immune system, for a high school student.",
    "Write an SQL query that finds the five customers with the highest total order value.",
    "What are the main causes of inflation? Answer in a few paragraphs.",
    "Write a polite email to a landlord asking for a broken heater to be repaired.",
    "Solve step by step: a train travels 180 km in 2.5 hours. What is its average speed?",
    "Give me a recipe for a vegetable soup, with a list of ingredients and steps.",
    "Write a JavaScript function that debounces another function, with comments.",
    "Summarize the history of the Roman Empire in a few sentences.",
    "Write a bash script that backs up a directory into a dated tar.gz archive.",
    "Describe the water cycle and why it matters for agriculture.",
    "Write a dialogue between a customer and a support agent about a late delivery.",
    "List ten tips for writing clear technical documentation, with a sentence on each.",
    "Write a C function that reverses a singly linked list, and explain how it works.",
    "Write a short poem about autumn in the mountains.",
)
# Two answers to each prompt, 192 tokens each: about 8,000 calibration tokens. On SmolLM2 (int4
# group 128) one answer gave perplexity +40.4%, two +33.0%, four +33.5%.
SAMPLES_PER_PROMPT = 2
NEW_TOKENS = 192
TEMPERATURE = 0.8
SEED = 0
BLOCK_SIZE = 16


def float32_sampler(model: LlamaForCausalLM, loaded: LoadedModel) -> LlamaForCausalLM:
    """The model that writes the calibration text: `model` itself when it is float32, else a
    float32 copy of its own values (`loaded` may hold float32 weights for a bfloat16 model, as
    `tokenmill eval` loads them), so a model samples the same text however it was loaded."""
    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    if dtype == torch.float32:
        return model
    return LlamaForCausalLM(model.config, {name: t.to(dtype) for name, t in loaded.weights.items()},
                            torch.float32, device)


def calibration_sequences(sampler: LlamaForCausalLM, loaded: LoadedModel) -> list[list[int]]:
    """`CALIBRATION_TEXT`, then each prompt (in the chat template when the model has one) with
    the continuations of `sampler` (float32_sampler); ids the model doesn't embed are dropped
    (the tests' tiny models know fewer ids than their tokenizer)."""
    config, tokenizer = sampler.config, loaded.tokenizer
    prompts = []
    for prompt in CALIBRATION_PROMPTS:
        if loaded.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   chat_template=loaded.chat_template,
                                                   add_generation_prompt=True, tokenize=False)
        prompts.append([t for t in tokenizer.encode(prompt) if t < config.vocab_size])
    text = [t for t in tokenizer.encode(CALIBRATION_TEXT) if t < config.vocab_size]
    return [text, *sample(sampler, prompts * SAMPLES_PER_PROMPT, NEW_TOKENS)]


@torch.inference_mode()
def sample(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int,
           temperature: float = TEMPERATURE, top_k: int = 0,
           seed: int = SEED) -> list[list[int]]:
    """Each prompt followed by `new_tokens` sampled tokens (no stop at end tokens: whatever the
    model writes after them is still its own text), all prompts in one batch; `top_k` 0 keeps
    every token."""
    device = model.norm.weight.device
    seq_blocks = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    tables = [list(range(i * seq_blocks, (i + 1) * seq_blocks)) for i in range(len(prompts))]
    caches = _kv_caches(model, len(model.layers), len(prompts) * seq_blocks)
    generator = torch.Generator(device=device).manual_seed(seed)
    sequences = [list(p) for p in prompts]
    input_ids, positions, meta = _prefill_inputs(model, prompts, tables)
    hidden = model(input_ids, positions, caches, meta)
    last_rows = torch.tensor(list(map(len, prompts)), device=device).cumsum(0) - 1
    logits = model.compute_logits(hidden[last_rows]).float()
    block_tables = torch.tensor(tables, device=device)
    use_kernel = decode_kernel_available(device)
    for step in range(new_tokens):
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).flatten()
        for sequence, token in zip(sequences, tokens.tolist()):
            sequence.append(token)
        if step == new_tokens - 1:
            break
        positions = torch.tensor([len(s) - 1 for s in sequences], device=device)
        slots = torch.tensor([cache_slot(t, p, BLOCK_SIZE)
                              for t, p in zip(tables, positions.tolist())], device=device)
        seq_lens = positions + 1
        mask = None if use_kernel else padding_mask(seq_lens, seq_blocks * BLOCK_SIZE,
                                                     model.norm.weight.dtype)
        meta = AttentionMetadata(slots, [], 0, block_tables, seq_lens, mask)
        logits = model.compute_logits(model(tokens, positions, caches, meta)).float()
    return sequences


class LayerwiseCalibration:
    """Calibration tokens' hidden states, advanced through the decoder one layer at a time, so
    layer i's products can be quantized before layer i + 1's inputs are computed from them.

    All sequences run as one prefill step (a chunk each), through one layer's KV cache reused by
    every layer: a prefill writes its keys and values before it reads them.
    """

    @torch.inference_mode()
    def __init__(self, model: LlamaForCausalLM, sequences: list[list[int]]) -> None:
        seq_blocks = [-(-len(s) // BLOCK_SIZE) for s in sequences]
        starts = [sum(seq_blocks[:i]) for i in range(len(sequences))]
        tables = [list(range(start, start + n)) for start, n in zip(starts, seq_blocks)]
        self.kv_cache = _kv_caches(model, 1, sum(seq_blocks))[0]
        input_ids, positions, self.meta = _prefill_inputs(model, sequences, tables)
        self.cos, self.sin = model.rotary.cos_sin(positions)
        self.hidden = model.embed_tokens(input_ids)
        self.residual: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self, layer: DecoderLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output on the current inputs; the inputs stay as they are. The layer adds
        into its residual stream in place (the first layer's is the embedding, `hidden`), so it
        runs on copies."""
        residual = None if self.residual is None else self.residual.clone()
        return layer(self.hidden.clone(), residual, self.cos, self.sin, self.kv_cache, self.meta)

    def advance(self, layer: DecoderLayer) -> None:
        """The layer's output becomes the next layer's input."""
        self.hidden, self.residual = self.run(layer)

    @torch.inference_mode()
    def final_hidden(self, model: LlamaForCausalLM) -> torch.Tensor:
        """After the last layer: the final-norm hidden states, the lm_head's inputs."""
        return model.norm(self.hidden, self.residual)[0]


def _kv_caches(model: LlamaForCausalLM, num_layers: int,
               num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    attention = model.layers[0].self_attn
    weight = model.norm.weight
    shape = (num_blocks, BLOCK_SIZE, attention.num_kv_heads, attention.head_dim)
    return [(torch.zeros(shape, dtype=weight.dtype, device=weight.device),
             torch.zeros(shape, dtype=weight.dtype, device=weight.device))
            for _ in range(num_layers)]


def _prefill_inputs(model: LlamaForCausalLM, sequences: list[list[int]], tables: list[list[int]]
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids, positions and metadata of one step that prefills every sequence whole."""
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    use_kernel = decode_kernel_available(device)
    chunks, slots, query_start = [], [], 0
    for sequence, table in zip(sequences, tables):
        n = len(sequence)
        chunks.append(prefill_chunk(query_start, n, n, torch.tensor(table, device=device),
                                    use_kernel, dtype, device))
        slots += [cache_slot(table, p, BLOCK_SIZE) for p in range(n)]
        query_start += n
    input_ids = torch.tensor([t for s in sequences for t in s], device=device)
    positions = torch.tensor([p for s in sequences for p in range(len(s))], device=device)
    meta = AttentionMetadata(torch.tensor(slots, device=device), chunks, query_start, None, None,
                             None)
    return input_ids, positions, meta
