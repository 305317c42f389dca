"""Tiny random vision models for the server's and the engine's image tests: a Gemma3ForConditionalGeneration
folder (transformers' own classes and save_pretrained) with a tokenizer that has Gemma 3's turn and image tokens,
Gemma 3's chat template and its processor's files, so that transformers' Gemma3Processor loads from it too; the
vision encoder tests' smaller Gemma3Config (one text layer) and image processor (a mean and std of its own).

The chat template (templates/gemma3.jinja) is Google's Gemma 3 instruction template as the checkpoints ship it
and as transformers' Gemma 3 processor tests use it: llama.cpp's template folder holds Gemma 2's and Gemma 4's but
no Gemma 3's. An image part renders `<start_of_image>`.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from tests.helpers.gemma_models import gemma3_config
from tests.helpers.models import save_random_model

TEMPLATE = Path(__file__).parent / "templates" / "gemma3.jinja"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0-3, as gemma3_config's pad / eos / bos
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]  # ids 314, 315
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
BOI_ID, EOI_ID, IMAGE_ID = 317, 318, 319  # the last ids of the 320 (Gemma 3: 255999, 256000, 262144)
END_OF_TURN_ID = 315
# ids 4-313, one token each: every token decodes to text on its own (a random model's answer is text, never
# half a character), so answers compare as text
CHARACTERS = ["\n"] + [chr(code) for code in range(33, 127)] + [chr(code) for code in range(0xC0, 0xC0 + 215)]
VOCAB_SIZE = 320


MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.3, 0.25]  # unlike the class defaults, so a folder's are seen read


def tiny_siglip(image_size: int, layers: int, **fields):
    """transformers' SiglipVisionConfig of the tiny tower: `layers` layers, hidden 32, 4 heads, `image_size` pixels
    in patches of 14; `fields` to its other fields."""
    import transformers

    return transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                           num_attention_heads=4, image_size=image_size, patch_size=14, **fields)


def tiny_gemma3(image_size: int = 56, mm_tokens: int = 4, layers: int = 2, **vision):
    """The vision encoder tests' Gemma3Config: the tiny SigLIP tower (`vision` to its other fields) over one text
    layer (gemma3_config's, Gemma 3's own sliding pattern), the image tokens at BOI_ID, EOI_ID and IMAGE_ID."""
    import transformers

    siglip = tiny_siglip(image_size, layers, **vision)
    text = gemma3_config(num_hidden_layers=1, final_logit_softcapping=None)
    return transformers.Gemma3Config(text_config=text, vision_config=siglip.to_dict(), mm_tokens_per_image=mm_tokens,
                                     image_token_index=IMAGE_ID, boi_token_index=BOI_ID, eoi_token_index=EOI_ID)


def gemma3_image_processor(size: int, **options):
    """transformers' Gemma3ImageProcessorPil at `size` pixels a side with MEAN and STD; `options` to its other
    fields."""
    import transformers

    return transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size}, image_mean=MEAN,
                                                image_std=STD, **options)


def save_processor(folder, size: int, **options) -> None:
    """gemma3_image_processor(size, **options)'s preprocessor config, saved into `folder`."""
    gemma3_image_processor(size, **options).save_pretrained(folder)


def tiny_gemma3_vision_config(image_size: int = 28, mm_tokens_per_image: int = 4, vision_layers: int = 2,
                              text_layers: int = 2, **changes):
    """transformers' Gemma3Config: a SigLIP tower of `image_size` pixels in patches of 14, hidden 32; a text model
    of `text_layers` (sliding, full, ...), hidden 64, window 16; `changes` to the Gemma3Config's own fields."""
    import transformers

    siglip = tiny_siglip(image_size, vision_layers)
    text = gemma3_config(num_hidden_layers=text_layers, sliding_window_pattern=2, final_logit_softcapping=None,
                         vocab_size=VOCAB_SIZE)
    return transformers.Gemma3Config(**(dict(text_config=text, vision_config=siglip.to_dict(),
                                             mm_tokens_per_image=mm_tokens_per_image, image_token_index=IMAGE_ID,
                                             boi_token_index=BOI_ID, eoi_token_index=EOI_ID) | changes))


def write_gemma3_tokenizer(folder: Path) -> None:
    """A sentencepiece-style BPE tokenizer.json (`▁` for spaces, no merges: one token per character, <unk> for
    characters beyond CHARACTERS) of 320 tokens with Gemma 3's special, turn and image tokens at the ids the
    config names; its decoder is Gemma's (byte fallback included, unused here: llguidance reads that form)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pieces = SPECIALS + CHARACTERS + TURN_TOKENS + ["▁"]
    pieces += list(IMAGE_TOKENS.values())
    assert len(pieces) == VOCAB_SIZE and pieces[BOI_ID] == IMAGE_TOKENS["boi_token"]
    backend = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, [], unk_token="<unk>",
                                   fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token in SPECIALS + TURN_TOKENS + list(IMAGE_TOKENS.values())])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "extra_special_tokens": IMAGE_TOKENS,
        "processor_class": "Gemma3Processor"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")


def write_tiny_gemma3_vision(folder: Path, seed: int = 0, **config) -> Path:
    """A tiny random Gemma3ForConditionalGeneration folder (weights from `seed`; `config`: tiny_gemma3_vision_config's
    arguments) with its tokenizer, chat template, image processor config (Gemma3ImageProcessorPil's defaults at the
    tower's size) and processor config (image_seq_length); generation ends at <eos> or <end_of_turn>."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = tiny_gemma3_vision_config(**config)
    save_random_model(folder, hf_config, seed=seed, model_class=transformers.Gemma3ForConditionalGeneration)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, END_OF_TURN_ID],
                                                               "bos_token_id": 2, "pad_token_id": 0}))
    write_gemma3_tokenizer(folder)
    size = hf_config.vision_config.image_size
    processor = transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size})
    processor.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma3Processor", "image_seq_length": hf_config.mm_tokens_per_image}))
    return folder


def png_file(image) -> bytes:
    """A Pillow picture as the PNG file a client would send."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    """A PNG file as an OpenAI `image_url` data URL."""
    return "data:image/png;base64," + base64.b64encode(data).decode()


def reference_processor(folder: Path):
    """transformers' Gemma3Processor from the folder (its tokenizer, image processor and chat template)."""
    import transformers

    return transformers.Gemma3Processor.from_pretrained(folder)


def assert_bad_weights_refused(folder: Path, scratch: Path, load, changes) -> None:
    """A vision loader (`load(folder)`) refuses each changed copy of `folder`'s weights, naming the tensor:
    `changes` is a list of (tensors -> changed tensors, the message's pattern); the configs are copied as they are."""
    import pytest
    from safetensors.torch import load_file, save_file

    from localserve.loading.vision import VisionLoadError

    for name in ("config.json", "preprocessor_config.json"):
        (scratch / name).write_text((folder / name).read_text())
    tensors = load_file(folder / "model.safetensors")
    for change, message in changes:
        save_file(change(tensors), scratch / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(VisionLoadError, match=message):
            load(scratch)
