"""Tensor parallelism over torch.distributed: which rows and columns each rank holds (shard.py),
the layers that split a product and all-reduce it (parallel_linear.py), the process group
(process_group.py), each step's inputs sent from rank 0 to the others (step_broadcast.py) and
the worker processes that run them (workers.py). See docs/scaling.md."""
