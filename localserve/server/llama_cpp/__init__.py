"""llama.cpp's own endpoints: tokenize, detokenize, apply-template, props."""
