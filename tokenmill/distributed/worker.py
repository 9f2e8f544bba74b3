"""The processes of ranks 1..N-1: join the group, build this rank's shard, then run every step
rank 0 sends until it says stop. Also the launcher of a node other than node 0, which runs only
workers.

A worker ignores Ctrl-C (the terminal sends it to the whole process group; rank 0 leads the
shutdown) and dies with its parent (PR_SET_PDEATHSIG), so no rank outlives the engine, even one
killed with SIGKILL. A worker whose peer vanished sees its collective fail and exits.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.process_group import init_process_group, node_ranks, rank_config
from tokenmill.distributed.shard import TensorShard
from tokenmill.distributed.step_broadcast import receive_step

logger = logging.getLogger("tokenmill.distributed")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent exits, however it exits.
    (Strictly, when the parent's thread that started it exits: engines start workers from the
    thread that builds them and keeps them.)"""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_worker(config: EngineConfig, rank: int) -> None:
    """Target of a worker process; `config` carries the rendezvous address."""
    die_with_parent()
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"tokenmill[rank {rank}]: %(message)s"))
    logging.getLogger("tokenmill").addHandler(handler)
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    # Imported here: the model runner imports this package to start workers on rank 0.
    from tokenmill.engine.model_runner import ModelRunner
    from tokenmill.model.loader import load_model

    config = rank_config(config, rank)
    torch.set_num_threads(config.num_threads)
    group = init_process_group(config, rank)
    runner = ModelRunner(config, load_model(config.model, config.torch_dtype()),
                         TensorShard(rank, config.tensor_parallel_size))
    try:
        while (step := receive_step(group, runner.device, runner.dtype, runner.block_size,
                                    runner.use_decode_kernel)) is not None:
            runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
    except RuntimeError as error:  # a peer went away mid-collective: nothing left to serve
        logger.error("stopping: %s", error)
        sys.exit(1)
    dist.destroy_process_group()


def run_node(config: EngineConfig) -> None:
    """Node k > 0: run this node's ranks until rank 0 stops them (or Ctrl-C here stops them)."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_worker, args=(config, rank),
                                 name=f"tokenmill-rank-{rank}") for rank in node_ranks(config)]
    for process in processes:
        process.start()
    logger.info("node %d: ranks %s started, waiting for rank 0 at %s", config.node_rank,
                list(node_ranks(config)), config.dist_init_addr)
    try:
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
    failed = [p.name for p in processes if p.exitcode]
    if failed:
        raise RuntimeError(f"{', '.join(failed)} exited with an error")
