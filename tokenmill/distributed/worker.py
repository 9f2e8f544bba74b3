"""The processes of ranks 1..N-1: join the group, build this rank's shard, then run every step
rank 0 sends until it says stop. Also the launcher of a node other than node 0, which runs only
workers. `python -m tokenmill.distributed.worker --rank R --parent-pid P --loaded-fd F` is how a
rank starts (WorkerProcess): its EngineConfig comes pickled on stdin.

A worker ignores Ctrl-C (the terminal sends it to the whole process group; rank 0 leads the
shutdown) and dies with its parent (PR_SET_PDEATHSIG), so no rank outlives the engine, even one
killed with SIGKILL. A worker whose peer vanished sees its collective fail and exits.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.process_group import init_process_group, node_ranks, rank_config
from tokenmill.distributed.shard import TensorShard
from tokenmill.distributed.step_broadcast import receive_step
from tokenmill.distributed.worker_process import WorkerProcess

logger = logging.getLogger("tokenmill.distributed")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent exits, however it exits.
    (Strictly, when the parent's thread that started it exits: engines start workers from the
    thread that builds them and keeps them.)"""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_worker(config: EngineConfig, rank: int, parent_pid: int, loaded_fd: int) -> None:
    """A worker process's life; `config` carries the rendezvous address, and a byte on
    `loaded_fd` tells the parent the weights are read."""
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the line above
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
    # The weights before the rendezvous: a file this rank can't read fails the engine's start,
    # where rank 0 waits for every rank, instead of its first step.
    loaded = load_model(config.model, config.torch_dtype())
    os.write(loaded_fd, b"1")
    os.close(loaded_fd)
    group = init_process_group(config, rank)
    runner = ModelRunner(config, loaded, TensorShard(rank, config.tensor_parallel_size))
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
    processes = [WorkerProcess(config, rank) for rank in node_ranks(config)]
    logger.info("node %d: ranks %s started, waiting for rank 0 at %s", config.node_rank,
                list(node_ranks(config)), config.dist_init_addr)
    try:
        for process in processes:
            process.wait_loaded()
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
    failed = next((p for p in processes if p.exitcode), None)
    if failed is not None:
        raise failed.exit_error("on this node")


def main() -> None:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank (started by tokenmill)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--loaded-fd", type=int, required=True)
    args = parser.parse_args()
    config = pickle.load(sys.stdin.buffer)
    run_worker(config, args.rank, args.parent_pid, args.loaded_fd)


if __name__ == "__main__":
    main()
