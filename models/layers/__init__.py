"""The layers families are built from: norms, rotary embeddings, linear and quantized linear layers, the
gated MLP, routers and the mixture-of-experts MLP, attention, and the decoder that stacks them."""
