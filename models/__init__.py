"""Model definitions. Every supported architecture is served by the one Llama-family implementation."""

from localserve.models.llama import ForwardContext, LlamaForCausalLM

__all__ = ["ForwardContext", "LlamaForCausalLM"]
