"""Fused and special operators, each beside its eager reference twin (the tests hold them equal).

attention.py: causal and sliding-window attention. The fused ops of model.fused_ops: norms.py
(residual add + LayerNorm / RMSNorm), activations.py (bias + GeLU, SwiGLU), rotary.py,
cross_entropy.py (LM head + loss chunked over tokens, serial or vocab-parallel); dispatch.py picks
Triton (triton_kernels.py, CUDA only) or, on CPU, the compiled or eager twin.
"""

from megascale.ops.activations import bias_gelu, linear_bias_gelu, swiglu
from megascale.ops.attention import (
    banded_attention,
    causal_attention,
    dense_band_attention,
    sliding_window_attention,
)
from megascale.ops.cross_entropy import chunked_cross_entropy, vocab_parallel_chunked_cross_entropy
from megascale.ops.norms import add_layer_norm, add_norm, add_rms_norm
from megascale.ops.rotary import apply_rotary

__all__ = [
    "add_layer_norm",
    "add_norm",
    "add_rms_norm",
    "apply_rotary",
    "banded_attention",
    "bias_gelu",
    "causal_attention",
    "chunked_cross_entropy",
    "dense_band_attention",
    "linear_bias_gelu",
    "sliding_window_attention",
    "swiglu",
    "vocab_parallel_chunked_cross_entropy",
]
