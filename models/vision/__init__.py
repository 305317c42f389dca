"""Vision encoders: the image side of the multimodal checkpoints, apart from the language model.

Gemma 3 (`Gemma3ForConditionalGeneration`): `config.py` reads its `vision_config` and image tokens,
`preprocess.py` turns Pillow images into pixel values as transformers' Gemma3ImageProcessor does,
`siglip.py` is the SigLIP vision transformer, `gemma3_projector.py` pools and projects its patches into the
language model's embedding space, and `gemma3_vision.py` joins them in `GemmaVision`
(`encode(pixel_values)`) and names where the checkpoint's tensors go. Files are read in
localserve/loading/vision.py (`load_gemma_vision`), as loading/ reads the text models'.

Qwen3.5 / Qwen3.6 (`Qwen3_5ForConditionalGeneration` and the MoE twin): `qwen3_5_vision.py` is the vision
transformer (3D patches, interpolated learned positions, 2D rotary, patch merger) with the image tokens'
mRoPE positions, `qwen_preprocess.py` the smart resize and patching of transformers' Qwen2-VL image
processor (its Pillow backend); localserve/loading/qwen_vision.py reads them (`load_qwen3_5_vision`).

Mistral Small 3.1 / 3.2 (`Mistral3ForConditionalGeneration`): `pixtral.py` is the Pixtral vision transformer
(pictures of any size, 2D rotary, attention within each picture) with Mistral 3's config, `mistral3_vision.py`
its patch-merging projector and `Mistral3Vision`, `pixtral_preprocess.py` PixtralImageProcessor's resize and
steps, `mistral3_encoder.py` the `ImageEncoder` ([IMG] rows joined by [IMG_BREAK]);
localserve/loading/pixtral_vision.py reads them (`load_mistral3_vision`).
"""
