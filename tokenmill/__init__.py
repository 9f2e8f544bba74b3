"""tokenmill: an LLM inference and serving engine in plain PyTorch."""

from tokenmill.config import EngineConfig
from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "__version__"]
