"""The offline API: LLM.generate and LLM.chat over one LLMEngine, with a progress bar."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", dtype: str = "auto",
                 **engine_options: object) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype=dtype,
                                                         **engine_options))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, Sequence) \
            else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # Only finished outputs are returned, so the engine builds no others (as vLLM's LLM).
        final = {id(p): dataclasses.replace(p, output_kind="final_only") for p in params}
        params = [final[id(p)] for p in params]
        # Tokenize and check everything first, so a bad prompt leaves no half-queued batch.
        token_ids = [self.engine.tokenize(p) for p in prompts]
        ids = []
        try:
            for prompt, tokens, p in zip(prompts, token_ids, params):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p, cache_salt=cache_salt,
                                        prompt_token_ids=tokens)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, conversations: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.engine.apply_chat_template(list(c)) for c in conversations]
        # The template already holds the special tokens, so none are added on top.
        token_ids = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_ids, sampling_params, use_tqdm, cache_salt)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so the next prompts compute from scratch (between runs
        of a benchmark, say); False while requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]
