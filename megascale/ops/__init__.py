"""Fused and special operators; each has an eager reference twin in the tests."""

from megascale.ops.attention import banded_attention, causal_attention, sliding_window_attention

__all__ = ["banded_attention", "causal_attention", "sliding_window_attention"]
