"""Block, layer-index and layer-class detection for Hugging Face and diffusers models."""
