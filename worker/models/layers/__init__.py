"""The decoder's layers: self-attention, DeepSeek's latent attention, the dense MLP, the
mixture-of-experts block, norms and rotary tables."""
