"""`tokenmill bench`: a serving benchmark for tokenmill and any OpenAI-compatible server.

datasets -> client (arrivals, streaming requests) -> metrics (vLLM's definitions) -> report;
sweep and peers start the servers they measure themselves (launch). See docs/benchmarks.md.
"""
