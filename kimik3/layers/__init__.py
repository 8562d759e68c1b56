"""Flax (Linen) layers of the Kimi Linear / K3 decoder. Used functionally: weights live in a plain
pytree passed to `Module.apply`; caches are explicit inputs and outputs."""
