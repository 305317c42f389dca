"""A tiny random Gemma3ForConditionalGeneration for engine-level image tests: its folder (the language model
loaded by localserve, the vision tower by `load_gemma_vision`), prompts laid out as Gemma3Processor writes
them (`<start_of_image>`, one soft token per image row, `<end_of_image>`), our engine's requests with
bidirectional spans, and transformers' greedy tokens and log-probabilities (pixel values and token_type_ids)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.multimodal import ImageSpan, MultiModalInputs
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from localserve.loading.vision import load_gemma_vision
from tests.helpers.gemma_models import WINDOW, gemma3_config
from tests.helpers.models import save_random_model

IMAGE_TOKEN, BOI, EOI = 319, 317, 318  # Gemma 3's soft token, <start_of_image>, <end_of_image> (tiny vocabulary)
IMAGE_SIZE = 56  # 4 x 4 patches of 14
TOP = 20  # log-probabilities compared per token (the most SamplingParams.logprobs gives)


def tiny_gemma3_vision_config(mm_tokens: int = 16, window: int = WINDOW):
    """Gemma 3 with a 2-layer SigLIP tower (56 px, 16 patches pooled to `mm_tokens` rows), a text model of a
    sliding layer (window 16 by default: as long as the longest image here) and a full one."""
    import transformers

    siglip = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=14)
    text = gemma3_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                         final_logit_softcapping=None, sliding_window=window)
    return transformers.Gemma3Config(text_config=text, vision_config=siglip.to_dict(), mm_tokens_per_image=mm_tokens,
                                     image_token_index=IMAGE_TOKEN, boi_token_index=BOI, eoi_token_index=EOI)


def write_gemma3_image_model(folder: Path, mm_tokens: int = 16, seed: int = 0, window: int = WINDOW):
    """The folder of a random tiny Gemma3ForConditionalGeneration (float32) and the transformers model."""
    import transformers

    return save_random_model(folder, tiny_gemma3_vision_config(mm_tokens, window), seed=seed,
                             model_class=transformers.Gemma3ForConditionalGeneration)


def load_gemma3_image_models(folder: Path, mm_tokens: int = 16):
    """(our text model, our vision encoder, transformers' model in eval mode) of a new random tiny Gemma 3 in
    `folder`, float32."""
    hf_model = write_gemma3_image_model(folder, mm_tokens).eval()
    return load_model(folder, dtype=torch.float32).model, load_gemma_vision(folder), hf_model


def pixels(seed: int) -> torch.Tensor:
    """One image's pixel values [3, 56, 56] as the processor would give them (normalised to about [-1, 1])."""
    return torch.rand(3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@dataclass
class ImagePrompt:
    """A prompt's ids with each image laid out as Gemma3Processor does, its images' pixel values in order and
    their spans (the soft tokens)."""

    token_ids: list[int] = field(default_factory=list)
    images: list[torch.Tensor] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (offset, length)

    @classmethod
    def of(cls, parts: list, mm_tokens: int) -> ImagePrompt:
        """Parts: token-id lists (text) and ints (an image: the seed of its pixels)."""
        prompt = cls([2])  # <bos>
        for part in parts:
            if isinstance(part, int):
                prompt.token_ids.append(BOI)
                prompt.spans.append((len(prompt.token_ids), mm_tokens))
                prompt.token_ids += [IMAGE_TOKEN] * mm_tokens + [EOI]
                prompt.images.append(pixels(part))
            else:
                prompt.token_ids += part
        return prompt

    def multimodal(self, vision, bidirectional: bool = True, calls: list | None = None) -> MultiModalInputs | None:
        """Our engine's image inputs: the spans (content hash: of the pixels) and GemmaVision.encode's rows,
        made on first use (`calls` counts them)."""
        if not self.spans:
            return None
        spans = tuple(ImageSpan(offset, length, hashlib.sha256(image.numpy().tobytes()).digest(), bidirectional)
                      for (offset, length), image in zip(self.spans, self.images))

        def embeddings(index: int) -> torch.Tensor:
            if calls is not None:
                calls.append(index)
            with torch.no_grad():
                return vision.encode(self.images[index][None])[0]

        return MultiModalInputs(spans, embeddings)


def make_engine(model, budget: int = 64, num_blocks: int = 256, mode: str = "recompute", prefix: bool = True,
                block_size: int = 16, **options) -> LLMEngine:
    return build_engine(model, None, EngineConfig(
        num_kv_blocks=num_blocks, block_size=block_size, max_num_seqs=min(16, budget), max_num_batched_tokens=budget,
        enable_prefix_caching=prefix, preemption_mode=mode, check_integrity=True, **options))


def params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)


def run(engine: LLMEngine, prompts: list[ImagePrompt], vision, max_tokens: int = 6, bidirectional: bool = True,
        calls: list | None = None) -> list:
    """Each prompt's final output, all submitted at once; the engine ends idle with every block back."""
    ids = [engine.add_request(prompt.token_ids, params(max_tokens),
                              multimodal=prompt.multimodal(vision, bidirectional, calls)) for prompt in prompts]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[request_id] for request_id in ids]


_REFERENCES: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}  # by model, prompt, images: the longest run


def reference(hf_model, prompt: ImagePrompt, max_tokens: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's log-probabilities [vocab] (a whole forward pass a token, the
    images given as pixel values, their soft tokens marked in token_type_ids: its bidirectional mask); kept,
    so a shorter run of the same model and prompt is a slice of a longer one (a forward pass costs ~0.4 s)."""
    key = (hf_model, tuple(prompt.token_ids), tuple(image.numpy().tobytes() for image in prompt.images))
    kept = _REFERENCES.get(key)
    if kept is None or len(kept[0]) < max_tokens:
        kept = _REFERENCES[key] = _reference(hf_model, prompt, max_tokens)
    return kept[0][:max_tokens], kept[1][:max_tokens]


def _reference(hf_model, prompt: ImagePrompt, max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = list(prompt.token_ids)
    pixel_values = torch.stack(prompt.images) if prompt.images else None
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            input_ids = torch.tensor([ids])
            token_type_ids = (input_ids == IMAGE_TOKEN).long()
            logits = hf_model(input_ids=input_ids, pixel_values=pixel_values, token_type_ids=token_type_ids).logits
            step = logits[0, -1].float().log_softmax(-1)
            logprobs.append(step)
            tokens.append(int(step.argmax()))
            ids.append(tokens[-1])
    return tokens, logprobs


def assert_matches(output, expected: tuple[list[int], list[torch.Tensor]], atol: float = 2e-4) -> None:
    """Our greedy tokens (`output`: a RequestOutput) are transformers'; each step's top log-probabilities equal
    its values at those ids."""
    tokens, logprobs = expected
    output = output.outputs[0]
    assert list(output.token_ids) == tokens
    for step, (top, reference_step) in enumerate(zip(output.top_logprobs, logprobs)):
        ids = torch.tensor([token for token, _ in top])
        ours = torch.tensor([value for _, value in top])
        torch.testing.assert_close(ours, reference_step[ids], atol=atol, rtol=0,
                                   msg=lambda message, step=step: f"step {step}: {message}")
