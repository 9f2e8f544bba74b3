"""TensorShard: which attention heads, KV heads and MLP columns one tensor-parallel rank holds.

Pure arithmetic over a ModelConfig, no communication. Query heads and MLP columns split evenly.
KV heads split evenly too when there are at least as many as ranks; when there are fewer, each
rank holds the one KV head its query heads read, so a KV head is replicated on
tensor_parallel_size / num_kv_heads ranks. Counts that don't divide are refused up front.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.model.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorShard:
    rank: int = 0
    world_size: int = 1

    def check(self, config: ModelConfig) -> None:
        """Raises ValueError naming tensor_parallel_size when the model can't be split so."""
        size = self.world_size
        problems = []
        if config.num_heads % size:
            problems.append(f"{config.num_heads} attention heads")
        if config.num_kv_heads % size and size % config.num_kv_heads:
            problems.append(f"{config.num_kv_heads} KV heads (they must divide or be a multiple "
                            "of the rank count)")
        if config.intermediate_size % size:
            problems.append(f"an MLP of {config.intermediate_size} columns")
        if problems:
            raise ValueError(f"invalid engine option tensor_parallel_size={size}: the model has "
                             f"{' and '.join(problems)}, which don't split across {size} ranks")

    def q_heads(self, config: ModelConfig) -> range:
        per_rank = config.num_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, config: ModelConfig) -> range:
        if config.num_kv_heads >= self.world_size:
            per_rank = config.num_kv_heads // self.world_size
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        # Fewer KV heads than ranks: this rank's query heads all read one KV head (a GQA group
        # spans world_size / num_kv_heads ranks), which it holds a copy of.
        head = self.rank * config.num_kv_heads // self.world_size
        return range(head, head + 1)

    def ffn_columns(self, config: ModelConfig) -> slice:
        per_rank = config.intermediate_size // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config as this rank sees it: its own head counts and MLP width."""
        return dataclasses.replace(
            config, num_heads=len(self.q_heads(config)), num_kv_heads=len(self.kv_heads(config)),
            intermediate_size=config.intermediate_size // self.world_size)


def head_rows(heads: range, head_dim: int) -> slice:
    """The rows of a q/k/v weight (or columns of o_proj's) that hold these heads."""
    return slice(heads.start * head_dim, heads.stop * head_dim)
