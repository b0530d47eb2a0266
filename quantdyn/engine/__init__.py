"""The measurement engine: a checkpoint read one decoder block at a time, quantized with any number of
quantizers and compared with full precision in one pass.

``lazy_model`` (a checkpoint as blocks, read lazily) -> ``blockwise`` (capture a block's inputs, quantize its
layers, run it) -> ``walk`` (every quantizer's stream and the shared full-precision stream through the blocks;
``streams`` keeps them in memory or spilled to disk) -> ``measure`` (the head: CE, KL, agreement per window)
-> ``rows`` (a measurement as result-row fields); ``sinks`` streams one quantizer's layers into a quantized
checkpoint or a deployable export.
"""
