"""Speculative decoding: proposers (n-gram lookup, a draft model), verification, throttling.

See docs/speculative.md. The engine holds one `Speculator` (speculator.py) when
EngineConfig.speculative_method is set; the model runner verifies with rejection.py.
"""
