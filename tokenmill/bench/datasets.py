"""Benchmark workloads, generated here from text that ships with Python, or read from a ShareGPT
file the user gives. Nothing is downloaded.

A workload is a list of conversations. Single-turn datasets give one request per conversation;
`multi-turn` gives several, sent one after another, each including the previous answers. Every
dataset is deterministic for a seed; `nonce` opens each shared text, so a run that uses a fresh
nonce starts from a cold prefix cache.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydoc_data.topics import topics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DATASETS = ("random", "shared-prefix", "mixed", "multi-turn", "sharegpt")

QUESTIONS = (
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain why the sky is blue.", "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish.", "What is 17 times 23?",
    "Give me a short recipe for pancakes.", "How do I reset my password?",
    "Can I change the size of a running instance?", "Why was I billed twice this month?",
    "How long are database backups kept?", "Which regions do you operate in?",
    "What does error code 503 mean?", "How do I rotate my API key?",
    "Is there a free tier for object storage?", "How do I open a support ticket?",
)
FOLLOW_UPS = (
    "Can you give a concrete example?", "Summarise that in one sentence.",
    "What is the most common mistake here?", "How would you explain it to a beginner?",
    "What should I read next?", "Is there a faster way?",
)
AGENT_INSTRUCTION = (
    "You are an operations agent for the Tokenmill cloud platform. Work step by step. When a "
    "tool can answer, reply only with one JSON object {\"tool\": NAME, \"arguments\": {...}} that "
    "matches the tool's schema; otherwise answer in at most three sentences, cite the section of "
    "the reference notes you used, never reveal internal identifiers, and hand billing disputes "
    "to a human."
)
TOOLS = (
    {"name": "search_docs", "description": "Full-text search over the product documentation.",
     "parameters": {"type": "object", "required": ["query"], "properties": {
         "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}}}},
    {"name": "create_ticket", "description": "Open a support ticket for the current customer.",
     "parameters": {"type": "object", "required": ["title", "severity"], "properties": {
         "title": {"type": "string"}, "severity": {"enum": ["low", "normal", "urgent"]},
         "body": {"type": "string"}}}},
    {"name": "get_invoice", "description": "Fetch one invoice with its line items.",
     "parameters": {"type": "object", "required": ["month"], "properties": {
         "month": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}}}},
    {"name": "resize_instance", "description": "Change the size of a compute instance.",
     "parameters": {"type": "object", "required": ["instance", "size"], "properties": {
         "instance": {"type": "string"}, "size": {"enum": ["small", "medium", "large"]}}}},
)
SUPPORT_INSTRUCTION = "You are a helpful support assistant. Answer briefly and precisely."


@dataclass(frozen=True)
class Conversation:
    """Requests sent one after another: user turns for the chat API, or one completions prompt."""
    groups: tuple[str, ...]  # the reporting group of each request
    output_len: int
    user_turns: tuple[str, ...] = ()
    system_prompt: str | None = None
    prompt: str | tuple[int, ...] | None = None  # /v1/completions (the random dataset)

    @property
    def num_requests(self) -> int:
        return len(self.groups)


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    num_prompts: int  # conversations
    output_len: int = 64
    input_len: int = 256  # random: prompt tokens; multi-turn: the first turn's passage
    range_ratio: float = 0.0  # random: lengths uniform in [len * (1 - r), len * (1 + r)]
    random_format: str = "ids"  # random: token ids, or text decoded from real text's tokens
    num_prefixes: int = 8  # shared-prefix: distinct system prompts
    prefix_len: int = 1000  # shared-prefix: tokens per system prompt
    long_fraction: float = 0.25  # mixed: share of long-document requests
    document_len: int = 1500  # mixed: tokens per long document
    num_turns: int = 4  # multi-turn
    sharegpt_path: Path | None = None
    seed: int = 0
    nonce: str = ""

    def __post_init__(self) -> None:
        checks = [
            (self.name in DATASETS, "dataset", f"must be one of {', '.join(DATASETS)}"),
            (self.num_prompts >= 1, "num_prompts", "must be >= 1"),
            (self.output_len >= 1, "output_len", "must be >= 1"),
            (self.input_len >= 1, "input_len", "must be >= 1"),
            (0.0 <= self.range_ratio < 1.0, "range_ratio", "must be in [0, 1)"),
            (self.random_format in ("ids", "text"), "random_format", "must be ids or text"),
            (self.num_prefixes >= 1, "num_prefixes", "must be >= 1"),
            (self.prefix_len >= 1, "prefix_len", "must be >= 1"),
            (0.0 <= self.long_fraction <= 1.0, "long_fraction", "must be in [0, 1]"),
            (self.document_len >= 1, "document_len", "must be >= 1"),
            (self.num_turns >= 1, "num_turns", "must be >= 1"),
            (self.name != "sharegpt" or self.sharegpt_path is not None, "sharegpt_path",
             "is required by the sharegpt dataset"),
        ]
        for ok, name, rule in checks:
            if not ok:
                value = getattr(self, name, self.name)
                raise ValueError(f"invalid benchmark option {name}={value!r}: {rule}")


class _Text:
    """Real text (the Python documentation's topics) as tokens, to cut passages of known length;
    tokenized on first use, once per tokenizer (it takes a second)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._token_ids: list[int] | None = None

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            corpus = "\n\n".join(topics[key] for key in sorted(topics))
            self._token_ids = self.tokenizer.encode(corpus, add_special_tokens=False)
        return self._token_ids

    def passage(self, rng: random.Random, num_tokens: int) -> str:
        start = rng.randrange(max(1, len(self.token_ids) - num_tokens))
        return self.tokenizer.decode(self.token_ids[start:start + num_tokens])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> "_Text":
        cached = _TEXTS.get(id(tokenizer))
        if cached is None or cached.tokenizer is not tokenizer:
            cached = _TEXTS[id(tokenizer)] = cls(tokenizer)
        return cached


_TEXTS: dict[int, _Text] = {}


def build_dataset(spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase) -> list[Conversation]:
    rng = random.Random(spec.seed)
    if spec.name == "sharegpt":
        return _sharegpt(spec, tokenizer, rng)
    text = _Text.of(tokenizer)
    builders = {"random": _random, "shared-prefix": _shared_prefix, "mixed": _mixed,
                "multi-turn": _multi_turn}
    return builders[spec.name](spec, text, rng)


def _scaled(rng: random.Random, length: int, ratio: float) -> int:
    return max(1, rng.randint(int(length * (1 - ratio)), int(length * (1 + ratio))))


def _random(spec: DatasetSpec, text: _Text, rng: random.Random) -> list[Conversation]:
    special = set(text.tokenizer.all_special_ids)
    vocabulary = [i for i in range(len(text.tokenizer)) if i not in special]
    conversations = []
    for _ in range(spec.num_prompts):
        input_len = _scaled(rng, spec.input_len, spec.range_ratio)
        prompt: str | tuple[int, ...]
        if spec.random_format == "ids":
            prompt = tuple(rng.choice(vocabulary) for _ in range(input_len))
        else:
            prompt = text.passage(rng, input_len)
        conversations.append(Conversation(("random",), _scaled(rng, spec.output_len,
                                                               spec.range_ratio), prompt=prompt))
    return conversations


def _shared_prefix(spec: DatasetSpec, text: _Text, rng: random.Random) -> list[Conversation]:
    system_prompts = []
    for index in range(spec.num_prefixes):
        tools = json.dumps([TOOLS[(index + k) % len(TOOLS)] for k in range(len(TOOLS))])
        head = (f"[run {spec.nonce}] Agent {index}. {AGENT_INSTRUCTION}\n\nTools (JSON "
                f"schema):\n{tools}\n\nReference notes:\n")
        filler = spec.prefix_len - text.count(head)
        system_prompts.append(head + (text.passage(rng, filler) if filler > 0 else ""))
    return [Conversation(("shared-prefix",), spec.output_len,
                         user_turns=(f"{rng.choice(QUESTIONS)} (ticket {number})",),
                         system_prompt=system_prompts[number % spec.num_prefixes])
            for number in range(spec.num_prompts)]


def _mixed(spec: DatasetSpec, text: _Text, rng: random.Random) -> list[Conversation]:
    conversations = []
    for number in range(spec.num_prompts):
        if rng.random() < spec.long_fraction:
            question = (f"[document {spec.nonce}-{number}]\n{text.passage(rng, spec.document_len)}"
                        "\n\nSummarise the document above in three sentences.")
            group = "long"
        else:
            question, group = f"{rng.choice(QUESTIONS)} (chat {spec.nonce}-{number})", "short"
        conversations.append(Conversation((group,), spec.output_len, user_turns=(question,),
                                          system_prompt=SUPPORT_INSTRUCTION))
    return conversations


def _multi_turn(spec: DatasetSpec, text: _Text, rng: random.Random) -> list[Conversation]:
    conversations = []
    for number in range(spec.num_prompts):
        opening = (f"[conversation {spec.nonce}-{number}]\n{text.passage(rng, spec.input_len)}\n\n"
                   "Explain the passage above.")
        turns = (opening, *(rng.choice(FOLLOW_UPS) for _ in range(spec.num_turns - 1)))
        conversations.append(Conversation(tuple(f"turn {k + 1}" for k in range(spec.num_turns)),
                                          spec.output_len, user_turns=turns,
                                          system_prompt=SUPPORT_INSTRUCTION))
    return conversations


def _sharegpt(spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase,
              rng: random.Random) -> list[Conversation]:
    """First human turn as the prompt; the first reply's length (capped at output_len) as the
    output length, as vllm bench does."""
    path = Path(spec.sharegpt_path)  # type: ignore[arg-type]
    try:
        entries = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"invalid benchmark option sharegpt_path={str(path)!r}: {error}") from None
    pairs = []
    for entry in entries if isinstance(entries, list) else []:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if first.get("from") == "human" and reply.get("from") == "gpt" and first.get("value"):
            pairs.append((first["value"], reply.get("value", "")))
    if not pairs:
        raise ValueError(f"invalid benchmark option sharegpt_path={str(path)!r}: no conversation "
                         "starts with a human turn followed by a gpt turn")
    rng.shuffle(pairs)
    return [Conversation(("sharegpt",), max(1, min(spec.output_len, len(tokenizer.encode(
        reply, add_special_tokens=False)))), user_turns=(question,))
        for question, reply in (pairs * (spec.num_prompts // len(pairs) + 1))[:spec.num_prompts]]
