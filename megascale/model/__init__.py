"""One GPT definition: sequential or parallel block, full or sliding-window attention,
GPT style (LayerNorm, GeLU, learned positions) or Llama style (RMSNorm, SwiGLU, rotary)."""

from megascale.model.factory import LayerFactory
from megascale.model.gpt import GPT, check_model_config

__all__ = ["GPT", "LayerFactory", "check_model_config"]
