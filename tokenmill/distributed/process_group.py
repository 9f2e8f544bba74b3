"""The torch.distributed process group of a tensor-parallel engine: placement of ranks on nodes,
rendezvous by TCP, backends and each rank's share of the CPU threads.

Two groups: the default one carries the model's all-reduces (gloo on CPU, NCCL on CUDA); a gloo
control group carries rank 0's step messages, on the host whatever the device, and waits as long
as a server stays idle.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig

# Start-up waits for every rank, which may sit on another host started by hand.
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)
# Workers wait on the control group for rank 0's next step for as long as the server is idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def ranks_per_node(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def node_ranks(config: EngineConfig) -> range:
    """The ranks that run on this node; node 0 holds rank 0, the engine."""
    per_node = ranks_per_node(config)
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def threads_per_rank(config: EngineConfig) -> int:
    """This node's threads (num_threads, or torch's default) shared among its ranks."""
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // ranks_per_node(config))


def with_rendezvous(config: EngineConfig) -> EngineConfig:
    """The config with a rendezvous address: on one node, a free loopback port if none given."""
    if config.dist_init_addr is not None:
        return config
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return dataclasses.replace(config, dist_init_addr=f"127.0.0.1:{port}")


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config one rank runs with: its device (cuda:<local rank>) and its thread share."""
    device = config.device
    if device.startswith("cuda"):
        device = f"cuda:{rank % ranks_per_node(config)}"
    return dataclasses.replace(config, device=device, num_threads=threads_per_rank(config))


def init_process_group(config: EngineConfig, rank: int) -> dist.ProcessGroup:
    """Joins the group (blocks until every rank has); returns the control group."""
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % ranks_per_node(config))
    dist.init_process_group(backend, init_method=f"tcp://{config.dist_init_addr}", rank=rank,
                            world_size=config.tensor_parallel_size, timeout=STARTUP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
