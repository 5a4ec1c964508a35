"""Tensor + sequence parallelism (Megatron-LM): the autograd-aware collectives (comm.py), the
parallel linear and embedding layers (layers.py), how a GPT is cut into them (apply.py), the
vocab-parallel loss (loss.py), partial gradients and norms (grads.py) and the one-process
state dict (state.py)."""
