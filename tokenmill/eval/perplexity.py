"""Perplexity on a fixed slice of the Python documentation that ships with every Python.

The text is `pydoc_data.topics`, its topics in sorted key order joined by blank lines; the slice
is its first `num_tokens` tokens, cut into windows scored independently (each window's first token
has no context and is not scored). The engine scores them as prompts (prompt logprobs), so the
measurement runs the serving path: chunked prefill, the paged and possibly int8 KV cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
from collections.abc import Callable

from pydoc_data.topics import topics

from tokenmill import LLM, SamplingParams

CHARS_PER_TOKEN_BOUND = 8  # tokenizing a prefix this many characters a token is always enough


def documentation_tokens(tokenize: Callable[[str], list[int]], num_tokens: int) -> list[int]:
    """The slice's tokens by `tokenize` (the engine's, or its tokenizer's encode)."""
    text = "\n\n".join(topics[key] for key in sorted(topics))
    tokens = tokenize(text[:num_tokens * CHARS_PER_TOKEN_BOUND])
    if len(tokens) < num_tokens:
        raise ValueError(f"invalid eval option num_tokens={num_tokens}: the text has fewer")
    return tokens[:num_tokens]


def slice_description(tokens: list[int]) -> str:
    """Which text a perplexity was measured on. pydoc_data.topics changes between Python
    releases (SmolLM2 in fp32: 13.100 on 3.11's slice, 13.773 on 3.12's), so perplexities compare
    only where the digests match."""
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]
    return (f"pydoc_data.topics of Python {platform.python_version()}, {len(tokens)} tokens, "
            f"sha256 {digest}")


def perplexity(llm: LLM, tokens: list[int], window: int) -> float:
    windows = [tokens[start:start + window] for start in range(0, len(tokens), window)]
    windows = [w for w in windows if len(w) > 1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(windows, params, use_tqdm=False)
    total, count = 0.0, 0
    for output in outputs:
        for token_id, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
            total += entry[token_id]
            count += 1
    return math.exp(-total / count)
