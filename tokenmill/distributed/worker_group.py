"""WorkerGroup: rank 0's handle on the other ranks of a tensor-parallel engine.

Rank 0 starts this node's workers, joins the process group, sends each step's inputs and stops
the workers when the engine shuts down: politely (a stop message, then a join) when the ranks
are in step, by terminating them when they can't be (an error or Ctrl-C mid-step). An atexit
hook covers an engine nobody shut down.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.process_group import (init_process_group, node_ranks, rank_config,
                                                 with_rendezvous)
from tokenmill.distributed.step_broadcast import send_step, send_stop
from tokenmill.distributed.worker_process import WorkerProcess
from tokenmill.model.attention import AttentionMetadata

logger = logging.getLogger("tokenmill.distributed")

JOIN_TIMEOUT_S = 30.0


class WorkerGroup:
    def __init__(self, processes: list[WorkerProcess], group: dist.ProcessGroup) -> None:
        self.processes = processes
        self.group = group
        self.in_step = False  # rank 0 sent a step whose forward has not finished
        self.stopped = False

    @classmethod
    def start(cls, config: EngineConfig) -> "WorkerGroup":
        """Start ranks 1.. of node 0 and join the group with every rank (other nodes' too)."""
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process; "
                               "shut it down (LLMEngine.shutdown) before starting another")
        config = with_rendezvous(config)
        torch.set_num_threads(rank_config(config, 0).num_threads)
        processes = [WorkerProcess(config, rank) for rank in node_ranks(config)[1:]]
        logger.info("tensor parallel: %d ranks over %d node(s), rendezvous at %s, %d threads "
                    "per rank; worker pids %s", config.tensor_parallel_size, config.nnodes,
                    config.dist_init_addr, torch.get_num_threads(), [p.pid for p in processes])
        workers = cls(processes, _join(config, processes))
        atexit.register(workers.shutdown)
        return workers

    @contextlib.contextmanager
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> Iterator[None]:
        """Send the step's inputs; the block runs rank 0's forward. Any failure inside leaves
        the ranks at different collectives, so it stops the workers before it propagates."""
        if self.stopped:
            raise RuntimeError("the tensor-parallel workers have stopped after an error")
        self.in_step = True
        try:
            # gloo may never notice a lost peer, so a send to a dead worker can block for good
            # (the control group's timeout is a year); this node's workers are checked first.
            dead = next((p for p in self.processes if not p.is_alive()), None)
            if dead is not None:
                raise dead.exit_error("mid-run")
            send_step(self.group, input_ids, positions, meta)
            yield
        except BaseException:
            self.shutdown()
            raise
        self.in_step = False

    def shutdown(self) -> None:
        """Stop every worker; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        if not self.in_step:
            try:
                send_stop(self.group)
            except RuntimeError as error:  # a worker is gone already
                logger.warning("tensor parallel: stop message failed: %s", error)
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S if not self.in_step else 0)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(config: EngineConfig, processes: list[WorkerProcess]) -> dist.ProcessGroup:
    """init_process_group once this node's workers have their weights, on a thread, so a worker
    that dies while joining is reported at once instead of after the rendezvous timeout."""
    try:
        for process in processes:
            process.wait_loaded()
    except RuntimeError:
        for process in processes:
            process.terminate()
        raise
    joined: list[dist.ProcessGroup | BaseException] = []

    def join() -> None:
        try:
            joined.append(init_process_group(config, 0))
        except BaseException as error:
            joined.append(error)

    thread = threading.Thread(target=join, name="tokenmill-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        dead = [p for p in processes if p.exitcode is not None]
        if dead and thread.is_alive():
            for process in processes:
                process.terminate()
            raise dead[0].exit_error("while starting")
    if isinstance(joined[0], BaseException):
        for process in processes:
            process.terminate()
        raise RuntimeError(f"tensor parallel: joining the process group at "
                           f"{config.dist_init_addr} failed: {joined[0]}")
    return joined[0]
