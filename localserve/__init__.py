"""localserve: a single-GPU LLM server with a paged, quantizable KV cache.

The public API: `LLM` (load a model and generate offline, or embed with an embedding model),
`SamplingParams`, `EmbeddingParams`, `EngineConfig`, `RequestOutput`. `LLM` pulls in torch and the
model code, so it is imported on first use.
"""

from localserve.engine.config import EngineConfig
from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.outputs import CompletionOutput, RequestOutput
from localserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EmbeddingParams", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from localserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'localserve' has no attribute {name!r}")
