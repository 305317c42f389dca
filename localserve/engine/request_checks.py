"""What a request must be to be taken (`LLMEngine.validate`, before add_request takes a block): a prompt of the
vocabulary's ids, its images' spans well formed and within a step, room in the context for the prompt and
max_tokens, a tokenizer where stop strings or reasoning markers need one, a grammar that compiles, no more
samples than slots, and blocks the pool could ever hold. Embedding requests: an embedding model, the context,
the dimensions the model can be shortened to. Everything read here is fixed when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass

from localserve.engine.admission import peak_blocks
from localserve.engine.config import EngineConfig
from localserve.engine.constraints import GrammarCompiler
from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.multimodal import MultiModalInputs, validate_multimodal
from localserve.engine.sampling_params import SamplingParams
from localserve.kv.block_manager import BlockManager
from localserve.models.config import ModelConfig

# An embedding request's sampling: nothing is sampled; one token of room is what its blocks are sized by
# (admission's peak_blocks), so it takes exactly its prompt's blocks.
PROMPT_ONLY = SamplingParams(max_tokens=1)


@dataclass(frozen=True)
class RequestChecks:
    """The settings a request is checked against (see the module's docstring)."""

    model_config: ModelConfig
    config: EngineConfig  # the pool's real size
    max_model_len: int
    can_generate: bool  # the model has an output head
    has_tokenizer: bool
    grammars: GrammarCompiler
    block_manager: BlockManager
    max_num_seqs: int
    max_span_tokens: int | None  # a step's tokens with chunked prefill (a bidirectional image must fit); None: off

    def check(self, prompt_token_ids: list[int], params: SamplingParams | EmbeddingParams,
              multimodal: MultiModalInputs | None = None) -> None:
        """Raise ValueError, saying what is wrong, unless the request could run."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab})")
        if multimodal is not None:
            validate_multimodal(multimodal, len(prompt_token_ids), self.model_config.hidden_size,
                                self.max_span_tokens)
            if multimodal.mrope is not None and self.model_config.rope.mrope_section is None:
                raise ValueError(f"multimodal: the images carry 3D rotary positions (rope_positions) but "
                                 f"{self.model_config.architecture} has no multimodal rotary (mrope_section)")
        if isinstance(params, EmbeddingParams):
            return self._check_embedding(prompt_token_ids, params)
        if not self.can_generate:
            raise ValueError("this model has no output head (an embedding model): it computes embeddings, "
                             "it cannot generate text")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds the context length of {self.max_model_len} tokens")
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer to detokenize the output, and this engine has none")
        if params.reasoning_end and not self.has_tokenizer:
            raise ValueError("a reasoning marker needs a tokenizer to detokenize the output, and this engine has none")
        self.grammars.check(params)  # compiled here (and kept), or refused naming why
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds the {self.max_num_seqs} parallel slots")
        # Exactly the tokens written: the last sampled token never is; samples share full prompt blocks.
        blocks = peak_blocks(len(prompt_token_ids), params.max_tokens, params.n, self.config.block_size)
        if not self.block_manager.can_ever_hold(len(prompt_token_ids), blocks):
            samples = f" for n={params.n}" if params.n > 1 else ""
            raise ValueError(f"the prompt plus max_tokens{samples} needs {blocks} blocks, the pool has "
                             f"{self.config.num_kv_blocks} (of {self.config.block_size} tokens): it can never run")

    def _check_embedding(self, prompt_token_ids: list[int], params: EmbeddingParams) -> None:
        pooling, hidden_size = self.model_config.pooling, self.model_config.hidden_size
        if pooling is None:
            raise ValueError("this model is not an embedding model (its folder has no sentence-transformers "
                             "pooling config, its GGUF no pooling_type): it generates text")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the input ({len(prompt_token_ids)} tokens) exceeds the context length of "
                             f"{self.max_model_len} tokens")
        if params.dimensions is not None:
            if not pooling.truncatable:
                raise ValueError("dimensions: this model's embeddings cannot be shortened (it is not trained for "
                                 "Matryoshka truncation)")
            if params.dimensions > hidden_size:
                raise ValueError(f"dimensions: at most the model's {hidden_size}, got {params.dimensions}")
        blocks = peak_blocks(len(prompt_token_ids), PROMPT_ONLY.max_tokens, 1, self.config.block_size)
        if not self.block_manager.can_ever_hold(len(prompt_token_ids), blocks):
            raise ValueError(f"the input needs {blocks} blocks, the pool has {self.config.num_kv_blocks} "
                             f"(of {self.config.block_size} tokens): it can never run")
