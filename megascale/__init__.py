"""megascale: train large language models from one CPU core to ten thousand GPUs."""

__version__ = "0.1.0"
