"""The serving engine: requests, KV blocks, scheduling, model execution and outputs."""
