"""Where checkpoints come from: local runs and checkpoint directories, hub revisions, and the public
trajectory presets (``presets/*.yaml``: one file per model family and size, every number with its source).

``trajectory`` turns a spec's ``trajectory:`` section into the checkpoints (points) to measure, with their
tokens and LR; ``presets`` reads the YAML files; the Hugging Face cache code lives here too.
"""
