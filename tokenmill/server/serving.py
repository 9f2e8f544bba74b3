"""OpenAI completions and chat completions over the AsyncEngine: a request in, a response or an
SSE stream out.

Each request is checked (model, queue room, context length, parameters) before it reaches the
engine, so a bad one costs the engine nothing. Streams send deltas of the engine's cumulative
outputs; tokenmill/server/streaming.py owns the engine streams, so a client that goes away,
streaming or not, aborts its requests at once and their KV blocks go back to the pool.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import AsyncEngine, EngineStoppedError, RequestStream
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, CompletionChoice,
                                       CompletionLogprobs, CompletionRequest, CompletionResponse,
                                       DeltaMessage, PromptTokensDetails, TokenLogprob,
                                       TopLogprob, Usage)
from tokenmill.server.streaming import EventStream, error_event, event, final_outputs, merge

RETRY_AFTER_SECONDS = "1"


@dataclass(slots=True)
class _Prompt:
    text: str | None
    token_ids: list[int] | None  # None: let the engine tokenize and refuse it (an empty prompt)


@dataclass(slots=True)
class _Sent:
    """How much of one choice a stream has sent."""
    chars: int = 0
    tokens: int = 0
    echoed: bool = False  # the prompt went out (echo: true)
    finished: bool = False


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, engine: LLMEngine, model_name: str,
                 max_waiting_requests: int) -> None:
        self.async_engine = async_engine
        self.engine = engine
        # Our own copy: the engine thread decodes with its tokenizer while we encode here.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.max_waiting_requests = max_waiting_requests

    # ---- checks -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", type="not_found_error", param="model",
                           code="model_not_found")

    def check_capacity(self) -> None:
        if self.async_engine.num_waiting >= self.max_waiting_requests:
            raise APIError(503, f"the server is busy: {self.async_engine.num_waiting} requests "
                           f"are waiting (--max-waiting-requests {self.max_waiting_requests}); "
                           "retry later", type="server_overloaded", code="server_overloaded",
                           headers={"Retry-After": RETRY_AFTER_SECONDS})

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        total = num_prompt_tokens + (max_tokens or 1)
        if total > self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} "
                           f"tokens, but {total} were requested ({num_prompt_tokens} in the "
                           f"prompt, {max_tokens or 1} to generate); shorten the prompt or "
                           "lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list) -> str:
        try:
            return self.engine.apply_chat_template([m.as_template_input() for m in messages])
        except ValueError as error:
            raise APIError.bad_request(error) from error

    # ---- endpoints --------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, salt: str | None,
                          raw: Request) -> Response:
        self.check_model(request.model)
        raw_prompts = request.prompt
        if isinstance(raw_prompts, str) or (raw_prompts and isinstance(raw_prompts[0], int)):
            raw_prompts = [raw_prompts]
        if not raw_prompts:
            raise APIError(400, "invalid request: prompt is empty", param="prompt")
        prompts = [_Prompt(p, self.encode(p) if p else None) if isinstance(p, str)
                   else _Prompt(None, None) for p in raw_prompts]
        params = self._params(request.to_sampling_params)
        for prompt, raw_prompt in zip(prompts, raw_prompts):
            self.check_length(len(prompt.token_ids or raw_prompt), params.max_tokens)
        streams = await self._submit("cmpl", raw_prompts, prompts, params, salt)
        request_id = streams[0].request_id.rpartition("-")[0]
        if request.stream:
            return EventStream(self._completion_events(request_id, request, streams, prompts),
                               streams)
        outputs = await final_outputs(streams, raw)
        choices = [self._completion_choice(index * params.n + c.index, output, c, request,
                                           prompts[index], _Sent())
                   for index, output in enumerate(outputs) for c in output.outputs]
        return JSONResponse(CompletionResponse(id=request_id, model=self.model_name,
                                               choices=choices,
                                               usage=_usage(outputs)).model_dump())

    async def chat(self, request: ChatCompletionRequest, salt: str | None,
                   raw: Request) -> Response:
        self.check_model(request.model)
        text = self.chat_prompt(request.messages)
        # The template already holds the special tokens, so none are added on top.
        prompt = _Prompt(text, self.encode(text, add_special_tokens=False))
        params = self._params(request.to_sampling_params)
        self.check_length(len(prompt.token_ids), params.max_tokens)
        streams = await self._submit("chatcmpl", [text], [prompt], params, salt)
        request_id = streams[0].request_id.rpartition("-")[0]
        if request.stream:
            return EventStream(self._chat_events(request_id, request, streams[0]), streams)
        [output] = await final_outputs(streams, raw)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              logprobs=self._chat_logprobs(c, request.top_logprobs or 0, 0),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in output.outputs]
        return JSONResponse(ChatCompletionResponse(id=request_id, model=self.model_name,
                                                   choices=choices,
                                                   usage=_usage([output])).model_dump())

    # ---- submitting ---------------------------------------------------------------------------

    @staticmethod
    def _params(build) -> SamplingParams:
        try:
            return build()
        except ValueError as error:
            raise APIError.bad_request(error) from error

    async def _submit(self, kind: str, raw_prompts: list, prompts: list[_Prompt],
                      params: SamplingParams, salt: str | None) -> list[RequestStream]:
        self.check_capacity()
        request_id = f"{kind}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for index, (raw_prompt, prompt) in enumerate(zip(raw_prompts, prompts)):
                streams.append(await self.async_engine.add_request(
                    f"{request_id}-{index}", raw_prompt, params, salt, prompt.token_ids))
        except BaseException as error:
            for stream in streams:
                stream.abort()
            if isinstance(error, ValueError):
                raise APIError.bad_request(error) from error
            if isinstance(error, EngineStoppedError):
                raise APIError(503, str(error), type="server_overloaded",
                               headers={"Retry-After": RETRY_AFTER_SECONDS}) from error
            raise
        return streams

    # ---- completions ------------------------------------------------------------------------

    def _completion_choice(self, index: int, output: RequestOutput, completion: CompletionOutput,
                           request: CompletionRequest, prompt: _Prompt,
                           sent: _Sent) -> CompletionChoice:
        """The choice's part after `sent`; with echo, the first part starts with the prompt."""
        echo = request.echo and not sent.echoed
        prefix = (prompt.text if prompt.text is not None
                  else self.tokenizer.decode(output.prompt_token_ids)) if echo else ""
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo:
                self._add_legacy_logprobs(logprobs, output.prompt_token_ids,
                                          output.prompt_logprobs, request.logprobs, 0)
            self._add_legacy_logprobs(logprobs, completion.token_ids[sent.tokens:],
                                      (completion.logprobs or [])[sent.tokens:],
                                      request.logprobs, len(prefix) + sent.chars)
        return CompletionChoice(index=index, text=prefix + completion.text[sent.chars:],
                                logprobs=logprobs, finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason)

    def _add_legacy_logprobs(self, logprobs: CompletionLogprobs, token_ids: list[int],
                             entries: list[dict[int, float] | None] | None, num_top: int,
                             offset: int) -> None:
        for token_id, entry in zip(token_ids, entries or [None] * len(token_ids)):
            token = self.tokenizer.decode([token_id])
            logprobs.tokens.append(token)
            logprobs.text_offset.append(offset)
            offset += len(token)
            logprobs.token_logprobs.append(None if entry is None else entry[token_id])
            logprobs.top_logprobs.append(None if entry is None else {
                self.tokenizer.decode([t]): v for t, v in _top(entry, num_top)})

    async def _completion_events(self, request_id: str, request: CompletionRequest,
                                 streams: list[RequestStream],
                                 prompts: list[_Prompt]) -> AsyncIterator[str]:
        n = request.n
        sent = [_Sent() for _ in range(len(streams) * n)]
        final: dict[int, RequestOutput] = {}
        async for index, output in merge(streams):
            if output.error:
                yield error_event(output.error)
                return
            choices = []
            for completion in output.outputs:
                progress = sent[index * n + completion.index]
                if progress.finished:
                    continue
                choice = self._completion_choice(index * n + completion.index, output,
                                                 completion, request, prompts[index],
                                                 progress)
                progress.chars, progress.tokens = len(completion.text), \
                    len(completion.token_ids)
                progress.echoed, progress.finished = True, completion.finished
                if choice.text or choice.finish_reason or choice.logprobs:
                    choices.append(choice)
            if choices:
                yield event(CompletionResponse(id=request_id, model=self.model_name,
                                                choices=choices))
            final[index] = output
        if request.include_usage:
            yield event(CompletionResponse(id=request_id, model=self.model_name, choices=[],
                                            usage=_usage([final[i] for i in sorted(final)])))
        yield "data: [DONE]\n\n"

    # ---- chat -------------------------------------------------------------------------------

    def _chat_logprobs(self, completion: CompletionOutput, num_top: int,
                       start: int) -> ChatLogprobs | None:
        if completion.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
            top = [self._top_logprob(t, v) for t, v in _top(entry, num_top)]
            chosen = self._top_logprob(token_id, entry[token_id])
            content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, value: float) -> TopLogprob:
        token = self.tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=value, bytes=list(token.encode()))

    async def _chat_events(self, request_id: str, request: ChatCompletionRequest,
                           stream: RequestStream) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice]) -> str:
            return event(ChatCompletionChunk(id=request_id, model=self.model_name,
                                              choices=choices))

        sent = [_Sent() for _ in range(request.n)]
        output = None
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                 content=""))
                     for i in range(request.n)])
        async for _, output in merge([stream]):
            if output.error:
                yield error_event(output.error)
                return
            choices = []
            for completion, progress in zip(output.outputs, sent):
                if progress.finished:
                    continue
                delta = completion.text[progress.chars:]
                logprobs = self._chat_logprobs(completion, request.top_logprobs or 0,
                                               progress.tokens)
                progress.chars, progress.tokens = len(completion.text), \
                    len(completion.token_ids)
                progress.finished = completion.finished
                if delta or completion.finished:
                    choices.append(ChatChunkChoice(
                        index=completion.index, delta=DeltaMessage(content=delta or None),
                        logprobs=logprobs, finish_reason=completion.finish_reason))
            if choices:
                yield chunk(choices)
        if request.include_usage and output is not None:
            yield event(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                             usage=_usage([output])))
        yield "data: [DONE]\n\n"


# ---- helpers ------------------------------------------------------------------------------------

def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:num_top]


def _usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(o.num_cached_tokens for o in outputs)))
