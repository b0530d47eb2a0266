"""quantdyn: how training dynamics decide post-training quantization robustness.

The public Python API is :mod:`quantdyn.api` (``import quantdyn.api as qd``; ``qd.measure``, ``qd.train``,
``qd.PTQMonitor``, ``qd.load_results`` ...).  ``import quantdyn`` itself imports nothing and has no side
effects.
"""

__version__ = "0.1.0"
