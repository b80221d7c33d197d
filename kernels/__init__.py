"""Custom ops. Model code calls these functions, never an implementation directly.

Each op has a plain-PyTorch reference (any device, the ground truth in tests) and, where one exists,
a faster path chosen by the input's device and dtype.
"""
from kernels.rms_norm import rms_norm, rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference"]
