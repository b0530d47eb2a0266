"""Measurement: quantize checkpoints and compare them with full precision, streamed block by block.

``engine.measure`` is the one place where "quantize, then compare" happens; ``rows`` turns its
results into store rows (keys, provenance). Layer: above quantize/, evaluate/, analysis/ and
train/; below study/, report/ and cli/.
"""
from quantdyn.measure.engine import MeasureConfig, Measurement, measure

__all__ = ["MeasureConfig", "Measurement", "measure"]
