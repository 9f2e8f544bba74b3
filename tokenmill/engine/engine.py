"""LLMEngine: add_request / abort_request / step over the scheduler and the model runner.

Each step schedules a batch, runs it, applies the sampled tokens, detokenizes, checks stop
conditions and returns outputs for the requests that moved. A request with n > 1 is a group of n
sequences sharing one prompt (and, through the prefix cache, its K/V). A fault while running a
batch fails the requests in that batch, never the engine. With speculative decoding a step can
emit several tokens per request; only the verified ones count as computed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer, text_decoder
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.metrics import EngineStats
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import ScheduledChunk, Scheduler
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.outputs import CompletionOutput, RequestOutput, RequestOutputMetrics
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.speculator import Speculator

logger = logging.getLogger("tokenmill.engine")


@dataclass(slots=True)
class _Group:
    """The sequences of one user request (n of them) and their detokenizers."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Request]
    detokenizers: list[IncrementalDetokenizer]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets several engines share one set of weights read from disk."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = loaded or load_model(config.model, config.torch_dtype())
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.decode_text = text_decoder(loaded.tokenizer)
        self.chat_template = loaded.chat_template
        model_len = loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"invalid engine option max_model_len={config.max_model_len}: the "
                             f"model supports at most {model_len} tokens")
        self.max_model_len = config.max_model_len or model_len
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids)
        self.runner = ModelRunner(config, loaded)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size,
                                       config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache)
        self.speculator = Speculator.create(config, loaded, self.runner.num_blocks,
                                            self.max_model_len)
        if self.speculator is not None:
            self.scheduler.on_release = self.speculator.release
        self.groups: dict[str, _Group] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- requests in ----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("invalid prompt: the prompt is empty")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("invalid prompt: the prompt has no tokens")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"invalid prompt: token id {bad[0]!r} is outside the vocabulary "
                             f"(0..{vocab - 1})")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                  add_generation_prompt=True, tokenize=False)

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None, cache_salt: str | None = None,
                    arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Queue a request; raises ValueError, and changes nothing, when it is invalid."""
        params = sampling_params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, which leaves no room to "
                             f"generate within max_model_len={self.max_model_len}")
        arrival = arrival_time or time.time()
        sequences, detokenizers = [], []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + index)
            request = Request(
                request_id=f"{request_id}:{index}", prompt_token_ids=token_ids,
                sampling_params=params, eos_token_ids=self.eos_token_ids,
                max_total_tokens=self.max_model_len, cache_salt=cache_salt,
                prompt=prompt if isinstance(prompt, str) else None, generator=generator)
            request.metrics.arrival_time = arrival
            if params.prompt_logprobs is not None:  # the first token has nothing to score it
                request.prompt_logprobs = [None] * len(token_ids)
            sequences.append(request)
            detokenizers.append(IncrementalDetokenizer.for_prompt(
                self.decode_text, token_ids, params.stop_strings, params.include_stop_str_in_output))
        self.groups[request_id] = _Group(request_id, prompt if isinstance(prompt, str) else None,
                                         token_ids, sequences, detokenizers)
        for request in sequences:
            self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for request in group.sequences:
            if not request.finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return self._fail_unschedulable()
        started = time.perf_counter()
        try:
            result = self.runner.execute(scheduled)
        except Exception as error:  # a fault fails this batch's requests, not the engine
            logger.exception("model step failed; failing the %d requests in the batch",
                             len(scheduled.chunks))
            failed = [c.request for c in scheduled.chunks]
            for request in failed:
                request.error = f"engine error: {error}"
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            return self._collect(failed)
        elapsed, now = time.perf_counter() - started, time.time()
        for chunk in scheduled.chunks:  # speculative tokens count once verified, below
            chunk.request.num_computed_tokens += chunk.num_new_tokens - chunk.num_spec_tokens
            if chunk.request.num_computed_tokens <= chunk.request.num_prompt_tokens:
                self.prompt_tokens_total += chunk.num_new_tokens
            self.kv_cache.commit_full_blocks(chunk.request)
        for scored in result.prompt_logprobs:  # a recompute after preemption rewrites the same
            end = scored.first_position + len(scored.entries)
            scored.request.prompt_logprobs[scored.first_position:end] = scored.entries
        for chunk, token_ids, logprobs in zip(result.sampled_chunks, result.token_ids,
                                              result.logprobs):
            self._append_tokens(chunk, token_ids, logprobs, now)
        if self.speculator is not None:
            if all(c.num_new_tokens - c.num_spec_tokens == 1 for c in scheduled.chunks):
                self.speculator.observe_step(scheduled.num_batched_tokens, elapsed)  # decode
            self.speculator.propose(self.scheduler.running)
        if self.config.debug_checks:
            self.kv_cache.check_invariants(self.scheduler.running)
            if self.speculator is not None:
                self.speculator.check_invariants()
        return self._collect([c.request for c in result.sampled_chunks])

    def _append_tokens(self, chunk: ScheduledChunk, token_ids: list[int],
                       logprobs: list[dict | None], now: float) -> None:
        """The accepted speculative tokens (if any), then the target's own; a stop ends it."""
        request = chunk.request
        for token_id, entry in zip(token_ids, logprobs):
            self._append_token(request, token_id, entry, now)
            if request.finished:
                break
        if chunk.num_spec_tokens:
            num_accepted = len(token_ids) - 1
            self.speculator.record(chunk.num_spec_tokens, num_accepted)
            if not request.finished:
                # The accepted tokens' K/V came from this pass; the rejected ones' blocks go.
                request.num_computed_tokens += num_accepted
                self.kv_cache.trim(request)

    def _append_token(self, request: Request, token_id: int, logprobs: dict | None,
                      now: float) -> None:
        request.output_token_ids.append(token_id)
        self.generation_tokens_total += 1
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        group = self.groups[request.request_id.rpartition(":")[0]]
        detokenizer = group.detokenizers[group.sequences.index(request)]
        detokenizer.add_token(token_id)
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        status = None
        if num_output >= params.min_tokens and (
                token_id in (params.stop_token_ids or ())
                or (not params.ignore_eos and token_id in request.eos_token_ids)):
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        elif detokenizer.stopped_on is not None:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, detokenizer.stopped_on
        elif num_output >= request.max_output_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            request.metrics.finished_time = now
            self.scheduler.finish(request, status)

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could run: the head request needs more KV blocks than the whole pool has."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        request = self.scheduler.waiting[0]
        need = -(-request.num_tokens // self.kv_cache.block_size)
        request.error = (f"the request needs {need} KV blocks but the pool has "
                         f"{self.kv_cache.pool.num_blocks}; raise --kv-cache-memory")
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        return self._collect([request])

    def _collect(self, requests: list[Request]) -> list[RequestOutput]:
        outputs, seen = [], set()
        for request in requests:
            # An unfinished sequence's group is unfinished: a final-only one has nothing to say
            # yet (LLM.generate's every request, every step; 0.44 ms of a 64-sequence step)
            if not request.finished and request.sampling_params.output_kind == "final_only":
                continue
            group_id = request.request_id.rpartition(":")[0]
            group = self.groups.get(group_id)
            if group is None or group_id in seen:
                continue
            seen.add(group_id)
            if not group.finished and \
                    group.sequences[0].sampling_params.output_kind == "final_only":
                continue
            outputs.append(self._output(group))
            if group.finished:
                del self.groups[group_id]
        return outputs

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for index, (request, detok) in enumerate(zip(group.sequences, group.detokenizers)):
            completions.append(CompletionOutput(
                index=index, text=detok.visible_text(request.finished),
                token_ids=list(request.output_token_ids),
                finish_reason=request.status.value if request.finished else None,
                stop_reason=request.stop_reason,
                logprobs=request.output_logprobs if request.sampling_params.logprobs is not None
                else None))
        first = group.sequences[0]
        m = first.metrics
        errors = [r.error for r in group.sequences if r.error]
        metrics = RequestOutputMetrics(m.arrival_time, m.first_scheduled_time,
                                       m.first_token_time, m.last_token_time,
                                       max((r.metrics.finished_time or 0.0
                                            for r in group.sequences), default=None) or None,
                                       m.num_cached_tokens, m.num_preemptions)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             group.finished, metrics, errors[0] if errors else None,
                             m.num_cached_tokens,
                             first.prompt_logprobs
                             if first.sampling_params.prompt_logprobs is not None else None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name): True, or False while requests hold blocks."""
        return self.kv_cache.reset_prefix_cache()

    @property
    def healthy(self) -> bool:
        return self.runner.healthy

    def shutdown(self) -> None:
        """Release what outlives a step: the tensor-parallel worker processes."""
        self.runner.shutdown()

    # ---- stats ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=pool.num_blocks - pool.num_free, num_kv_blocks_total=pool.num_blocks,
            prefix_cache_queries=self.kv_cache.stats.queries,
            prefix_cache_hits=self.kv_cache.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_decode=self.speculator.stats.snapshot() if self.speculator else None)
