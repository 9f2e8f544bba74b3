"""Draft-model proposer: a smaller model with the target's tokenizer (or the target's own int4
form, or its first layers) guesses the next tokens greedily, one batched draft pass per position.

The draft keeps its own paged KV cache: a second ModelRunner (its own weights and pool) and a
KVCacheManager (the same block accounting, prefix caching off). Each target request has a shadow
Request that holds the draft's block table and progress; its tokens are the target's verified
tokens followed by the draft's latest proposals. Before proposing, the shadow rolls back to the
tokens the target kept and frees the blocks past them. `release` frees a shadow; the engine
calls it when its request finishes, is aborted or is preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.config import EngineConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.sampling_params import SamplingParams

DRAFT_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(slots=True)
class _Shadow:
    view: Request  # the draft's block table and num_computed_tokens over the request's tokens
    num_verified: int = 0  # leading output tokens known to equal the target request's


class DraftProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kv_cache = KVCacheManager(runner.num_blocks, runner.block_size,
                                       enable_prefix_caching=False)
        self.shadows: dict[Request, _Shadow] = {}

    @classmethod
    def load(cls, config: EngineConfig, target: LoadedModel, num_blocks: int,
             max_model_len: int) -> "DraftProposer":
        """The draft of `config.speculative_method` (draft or self), with a pool of the target's
        size in blocks."""
        if config.speculative_method == "self":
            loaded, name = target, config.model
            if config.speculative_draft_layers is not None:
                if config.speculative_draft_layers > target.config.num_layers:
                    raise ValueError(
                        f"invalid engine option speculative_draft_layers="
                        f"{config.speculative_draft_layers}: the model has "
                        f"{target.config.num_layers} layers")
                loaded = replace(target, config=replace(
                    target.config, num_layers=config.speculative_draft_layers))
            quantization = config.speculative_quantization or "int4"
        else:
            name = config.speculative_model
            loaded = load_model(name, config.torch_dtype())
            check_same_vocabulary(target, loaded, name)
            quantization = config.speculative_quantization or config.quantization
        if loaded.config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"invalid engine option speculative_model={name!r}: it handles "
                f"{loaded.config.max_position_embeddings} tokens, fewer than max_model_len="
                f"{max_model_len}")
        # The draft runs whole on rank 0, beside the target's rank-0 shard.
        draft_config = replace(config, model=name, quantization=quantization,
                               num_kv_blocks=num_blocks, tensor_parallel_size=1,
                               speculative_method=None,
                               speculative_model=None, speculative_draft_layers=None)
        return cls(ModelRunner(draft_config, loaded))

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to `num_tokens[i]` draft tokens for each request; [] where the draft pool is full."""
        shadows: list[_Shadow | None] = []
        for request, count in zip(requests, num_tokens):
            shadow = self._sync(request)
            # Slots for the tokens it has not computed and for all proposals but the last.
            needed = shadow.view.num_tokens - shadow.view.num_computed_tokens + count - 1
            shadows.append(shadow if self.kv_cache.allocate(shadow.view, needed) else None)
        proposals: list[list[int]] = [[] for _ in requests]
        for _ in range(max(num_tokens, default=0)):
            active = [i for i, s in enumerate(shadows)
                      if s is not None and len(proposals[i]) < num_tokens[i]]
            if not active:
                break
            chunks = [ScheduledChunk(shadows[i].view, shadows[i].view.num_tokens
                                     - shadows[i].view.num_computed_tokens) for i in active]
            result = self.runner.execute(SchedulerOutput(chunks))
            for i, chunk, [token_id] in zip(active, chunks, result.token_ids):
                chunk.request.num_computed_tokens += chunk.num_new_tokens
                chunk.request.output_token_ids.append(token_id)
                proposals[i].append(token_id)
        return proposals

    def _sync(self, request: Request) -> _Shadow:
        """Bring the shadow up to the request's verified tokens, dropping rejected proposals."""
        shadow = self.shadows.get(request)
        if shadow is None:
            shadow = self.shadows[request] = _Shadow(Request(
                request.request_id, request.prompt_token_ids, DRAFT_PARAMS, frozenset(),
                request.max_total_tokens))
        drafted, verified = shadow.view.output_token_ids, request.output_token_ids
        same = shadow.num_verified
        while same < min(len(drafted), len(verified)) and drafted[same] == verified[same]:
            same += 1
        del drafted[same:]
        drafted.extend(verified[same:])
        shadow.num_verified = len(verified)
        view = shadow.view
        view.num_computed_tokens = min(view.num_computed_tokens, view.num_prompt_tokens + same)
        self.kv_cache.trim(view)
        return shadow

    def release(self, request: Request) -> None:
        shadow = self.shadows.pop(request, None)
        if shadow is not None:
            self.kv_cache.free(shadow.view)

    def check_invariants(self) -> None:
        self.kv_cache.check_invariants([s.view for s in self.shadows.values()])


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel, name: str) -> None:
    """A draft proposes token ids, so they must mean the same text to the target."""
    if draft.config.vocab_size != target.config.vocab_size \
            or draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"invalid engine option speculative_model={name!r}: its vocabulary "
            f"({draft.config.vocab_size} ids) differs from the target model's "
            f"({target.config.vocab_size} ids); a draft must share the target's tokenizer")
