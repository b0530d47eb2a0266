"""quantdyn: how training dynamics decide post-training quantization robustness.

The public Python API is :mod:`quantdyn.api` (``import quantdyn.api as qd``; ``qd.train``, ``qd.cooldown``,
``qd.quantize_checkpoint``, ``qd.measure``, ``qd.run_sweep``, ``qd.load_results``, ``qd.write_report`` ...).
It is not re-exported here: ``quantdyn.train``, ``quantdyn.measure``, ``quantdyn.quantize`` and
``quantdyn.report`` are subpackages, and ``import quantdyn`` itself imports nothing and has no side effects.

Layers, top to bottom; a module imports only from layers below its own (``|``: independent siblings).
pyproject.toml's import-linter contract states the same list and tests/test_layers.py enforces it:

    __main__, cli           the command line (typer), one module per family of commands
    api                     the public Python API
    experiments             studies end to end: StudySpec, findings with verdicts
    report                  figures and the HTML report
    study                   sweeps, trajectories and presets, grids, SLURM, accuracy, analysis rows
    monitor                 the PTQ monitor for any training loop (+ HF Trainer / Lightning adapters)
    measure                 the streamed measurement engine: quantize and compare, rows, saving
    train | analysis | export    trainer, schedules, averaging | sharpness, outliers, propagation |
                            GPTQ / compressed-tensors checkpoints
    quantize | evaluate     GPTQ/AWQ/RTN as tensor functions, the block walk | CE, KL, lm-eval adapter
    data | models | trajectories   token shards | model file, HF I/O, lazy weights | preset YAML files
    results                 the JSONL result store and its tables
    config | registry | files | runtime | progress   typed configs, registries, atomic writes,
                            devices and provenance, progress lines
    errors                  QuantdynError: every user error as one line

Function-local imports are kept for optional or heavy dependencies (lm-eval, pandas, wandb, ...) and in
``cli``, so that ``quantdyn -h`` answers without importing torch.
"""

__version__ = "0.1.0"
