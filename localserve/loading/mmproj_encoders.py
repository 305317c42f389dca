"""The image encoder of a GGUF pair (a language model's .gguf and llama.cpp's mmproj file, `--mmproj`): the
mmproj's projector type picks the family's reader (loading/mmproj.py for Gemma 3, loading/mmproj_qwen.py for
Qwen3.5, loading/mmproj_pixtral.py for Mistral 3), after the pair is checked (the family and hidden size of the
language model)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from localserve.loading.hf import LoadedModel
from localserve.loading.mmproj import MmprojFile, check_language_model, gemma3_mmproj_encoder
from localserve.loading.mmproj_pixtral import pixtral_mmproj_encoder
from localserve.loading.mmproj_qwen import qwen_mmproj_encoder
from localserve.models.config import ModelConfig
from localserve.models.vision.adapter import ImageEncoder
from localserve.tokenizer.tokenizer import Tokenizer

MmprojEncoderLoader = Callable[[MmprojFile, Path, ModelConfig, dict, torch.dtype, torch.device | str], ImageEncoder]

# by clip.projector_type
MMPROJ_ENCODERS: dict[str, MmprojEncoderLoader] = {"gemma3": gemma3_mmproj_encoder,
                                                   "qwen3vl_merger": qwen_mmproj_encoder,
                                                   "pixtral": pixtral_mmproj_encoder}


def load_mmproj_encoder(mmproj: MmprojFile, model: Path, config: ModelConfig, architecture: str,
                        vocabulary: dict[str, int], dtype: torch.dtype,
                        device: torch.device | str) -> ImageEncoder:
    """The image encoder of the pair (the language model's .gguf at `model`, its `config`, its
    `general.architecture` and its tokenizer's vocabulary: token text -> id)."""
    check_language_model(mmproj, architecture, config.hidden_size, str(model))
    return MMPROJ_ENCODERS[mmproj.projector](mmproj, model, config, vocabulary, dtype, device)



def mmproj_encoder_for(mmproj: MmprojFile, loaded: LoadedModel, tokenizer: Tokenizer, dtype: torch.dtype,
                       device: torch.device | str) -> ImageEncoder:
    """`load_mmproj_encoder` for a loaded language model (its .gguf's reader and config) and its tokenizer."""
    architecture = loaded.gguf_reader.fields["general.architecture"].contents()
    vocabulary = tokenizer.backend.get_vocab(with_added_tokens=True)
    return load_mmproj_encoder(mmproj, loaded.path, loaded.config, architecture, vocabulary, dtype, device)
