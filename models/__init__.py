"""Model definitions (imported as `localserve.models`): one file per family (llama.py, qwen2.py, ...), each
declaring a `Family` (family.py) built from the shared layers in layers/; registry.py finds a family by
its Hugging Face or GGUF architecture name; protocol.py is what the engine sees of a model (`CausalLM`);
config.py holds the `ModelConfig` every family reads its configs into.

Nothing heavy is imported here.
"""
