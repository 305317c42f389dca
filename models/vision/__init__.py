"""Vision encoders: the image side of the multimodal checkpoints, apart from the language model.

Gemma 3 (`Gemma3ForConditionalGeneration`): `preprocess.py` turns Pillow images into pixel values as
transformers' Gemma3ImageProcessor does, `siglip.py` is the SigLIP vision transformer, `gemma3_projector.py`
pools and projects its patches into the language model's embedding space, and `gemma3_vision.py` reads the
tower and projector from a checkpoint folder into `GemmaVision` (`encode(pixel_values)`).
"""
