"""A tiny Mistral3ForConditionalGeneration (Mistral Small 3.x's architecture: a Pixtral tower, Mistral 3's
projector and a Mistral decoder) saved as transformers saves it, with an image processor config, and a
tokenizer holding Mistral's control tokens at their real ids ([IMG] 10, [IMG_BREAK] 12, [IMG_END] 13) and
the real Mistral Small 3.2 chat template (llama.cpp's copy, tests/helpers/llama_cpp_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

# Mistral's first control tokens in their order (ids 0..), as its tokenizers number them
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
            "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[CALL_ID]", "[ARGS]"]
IMG, IMG_BREAK, IMG_END = 10, 12, 13
PATCH, MERGE = 4, 2  # an image token covers 8 x 8 pixels
LONGEST_EDGE = 48  # the processor's bound: at most 6 x 6 image tokens
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.3, 0.25]  # unlike the class defaults, so the folder's are read
TEMPLATE = "Mistral-Small-3.2-24B-Instruct-2506.jinja"
VOCAB = 600


def tiny_mistral3_config(vision: dict | None = None, text: dict | None = None, **fields):
    import transformers

    text_config = transformers.MistralConfig(**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-5, sliding_window=None) | (text or {}))
    vision_config = transformers.PixtralVisionConfig(**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
        patch_size=PATCH, hidden_act="silu") | (vision or {}))
    return transformers.Mistral3Config(text_config=text_config.to_dict(), vision_config=vision_config.to_dict(),
                                       **{"image_token_index": IMG, "spatial_merge_size": MERGE} | fields)


def reference_image_processor(**options):
    """transformers' PixtralImageProcessorPil as PixtralProcessor drives it: patches of an image token's side."""
    import transformers

    fields = dict(patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE}, size={"longest_edge": LONGEST_EDGE},
                  image_mean=MEAN, image_std=STD) | options
    return transformers.PixtralImageProcessorPil(**fields)


def write_tokenizer(folder: Path, chat_template: str | None = None) -> None:
    from tests.helpers.llama_cpp_files import template_text
    from tests.helpers.tokenizers import train_bpe

    train_bpe(SPECIALS, vocab_size=VOCAB).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template or template_text(TEMPLATE)}))


def write_tiny_mistral3(folder: Path, seed: int = 0, vision: dict | None = None, text: dict | None = None,
                        processor: bool = True, **fields):
    """The folder (save_pretrained of random wide weights, float32), a processor config as PixtralProcessor
    saves it (processor_config.json with its image_processor), a tokenizer with the template; returns
    transformers' model."""
    import transformers

    from tests.helpers.models import save_random_model

    hf_model = save_random_model(folder, tiny_mistral3_config(vision, text, **fields), seed=seed,
                                 model_class=transformers.Mistral3ForConditionalGeneration)
    if processor:
        image_processor = json.loads(reference_image_processor().to_json_string())
        (folder / "processor_config.json").write_text(json.dumps({
            "image_processor": image_processor, "patch_size": PATCH, "spatial_merge_size": MERGE,
            "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
            "processor_class": "PixtralProcessor"}))
    write_tokenizer(folder)
    return hf_model
