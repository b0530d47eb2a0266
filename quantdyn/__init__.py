"""quantdyn: how training dynamics decide post-training quantization robustness."""

__version__ = "0.1.0"
