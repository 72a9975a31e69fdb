"""Layers with flash-attn's module paths (``flash_attn.layers``): ``tileattn.layers.rotary``."""
