"""Measurement orchestration: checkpoints x quantizers -> result rows.

``sweep`` (a trajectory's checkpoints, resumable, sharded), ``quantize_one`` (one model, one quantizer: what
``quantdyn quantize`` runs), ``interpolation`` (weights between two checkpoints), ``accuracy`` (downstream
accuracy of quantized twins), ``analysis_rows`` / ``analyze`` (sharpness, outliers, propagation, curvature rows).
"""
