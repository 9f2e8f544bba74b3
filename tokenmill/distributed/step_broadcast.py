"""Rank 0 sends each step's model inputs to the other ranks; they rebuild the same tensors.

One step is two broadcasts on the control group: a header of five numbers, then one int64 tensor
holding the token ids, positions, slots, each prefill chunk's extent and block table, and the
decode block tables and lengths. Masks are derived data: each rank rebuilds them with the same
helpers the model runner uses, so megabytes of masks never cross the wire. A header with a
negative token count tells the workers to stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenmill.model.attention import AttentionMetadata, padding_mask, prefill_chunk

_STOP = -1
_HEADER = 5  # tokens, prefill chunks, decodes, decode table width, payload length


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def send_step(group: dist.ProcessGroup, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> None:
    prefill_extents = [value for chunk in meta.prefills for value in (
        chunk.query_start, chunk.query_len, chunk.context_len, chunk.block_table.numel())]
    parts = [input_ids, positions, meta.slot_mapping,
             torch.tensor(prefill_extents, dtype=torch.long),
             *(chunk.block_table for chunk in meta.prefills)]
    width = 0
    if meta.decode_block_tables is not None:
        width = meta.decode_block_tables.shape[1]
        parts += [meta.decode_block_tables.flatten(), meta.decode_seq_lens]
    payload = torch.cat([part.cpu() for part in parts])
    header = torch.tensor([input_ids.numel(), len(meta.prefills), meta.num_decodes, width,
                           payload.numel()], dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def send_stop(group: dist.ProcessGroup) -> None:
    dist.broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.long), src=0,
                   group=group)


def receive_step(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 block_size: int, use_decode_kernel: bool) -> StepTensors | None:
    """The next step's inputs, or None when rank 0 says stop."""
    header = torch.empty(_HEADER, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    num_tokens, num_prefills, num_decodes, width, length = header.tolist()
    if num_tokens == _STOP:
        return None
    payload = torch.empty(length, dtype=torch.long)
    dist.broadcast(payload, src=0, group=group)
    sizes = [num_tokens] * 3 + [4 * num_prefills]
    *flat, extents_flat, rest = payload.split(sizes + [length - sum(sizes)])
    input_ids, positions, slots = (values.to(device) for values in flat)
    extents = extents_flat.view(num_prefills, 4).tolist()
    prefills, offset = [], 0
    for query_start, query_len, context_len, num_blocks in extents:
        prefills.append(prefill_chunk(query_start, query_len, context_len,
                                      rest[offset:offset + num_blocks].to(device),
                                      use_decode_kernel, dtype, device))
        offset += num_blocks
    tables = seq_lens = decode_mask = None
    if num_decodes:
        tables = rest[offset:offset + num_decodes * width].view(num_decodes, width).to(device)
        seq_lens = rest[offset + num_decodes * width:].to(device)
        if not use_decode_kernel:
            decode_mask = padding_mask(seq_lens, width * block_size, dtype)
    meta = AttentionMetadata(slots, prefills, sum(e[1] for e in extents), tables, seq_lens,
                             decode_mask)
    return StepTensors(input_ids, positions, meta)
