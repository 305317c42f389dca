"""localserve: a single-GPU LLM server with a paged, quantizable KV cache."""

from localserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; importing it lazily keeps `import localserve` light.
    if name == "LLM":
        from localserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'localserve' has no attribute {name!r}")
