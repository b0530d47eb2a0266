"""quantdyn: how training dynamics decide post-training quantization robustness.

The public Python API is :mod:`quantdyn.api` (``import quantdyn.api as qd``; ``qd.train``, ``qd.cooldown``,
``qd.quantize_checkpoint``, ``qd.measure``, ``qd.run_sweep``, ``qd.load_results``, ``qd.write_report`` ...).
It is not re-exported here: ``import quantdyn`` itself imports nothing and has no side effects.

The house, top to bottom, is the pipeline: training writes checkpoints, sources find them, the engine
measures them, sweeps and the monitor turn measurements into rows, studies and the report read the rows.
A module imports only from rows below its own (``|``: independent siblings). This picture is the one
statement of the layers: pyproject.toml's import-linter contract lists the same rows and
tests/test_layers.py checks that the two agree and that the code keeps to them.

    __main__                     ``python -m quantdyn``
    cli                          the command line (typer): one module per command family, named for it
    api                          the public Python API
    studies                      a study spec -> runs, cooldowns, averages, sweep, findings with verdicts
    ship                         what to deploy at a size budget: candidates x quantizations, screened,
                                 decided paired with uncertainty, exported
    report | launch              figures and the HTML page from rows | grids, torchrun, SLURM arrays
    sweep | monitor              checkpoints x quantizers -> rows | the same inside any training loop
    engine                       block walk, activation streams, measure(), one writer of quantized files
    sources                      where checkpoints come from: runs, directories, hub revisions, presets
    train | analysis | export    trainer, schedules, optimizers, averaging, QAT | sharpness, outliers,
                                 propagation, scaling fits | GPTQ and compressed-tensors layouts
    quantize | evaluate          pure quantization algorithms | loss, KL, agreement, lm-eval
    data | models                token sources and shards | the model file, HF I/O, lazy checkpoint weights
    results                      the row schema, the statistics of rows, the JSONL store and its tables
    runs | schedules             the run-directory layout and every name in it (checkpoints, branches,
                                 averages) | LR schedules as pure functions of the step
    config | registry | files | runtime | progress    typed configs, one Registry, atomic writes,
                                 devices and provenance, progress lines
    errors                       QuantdynError: every user error as one line

Function-local imports are kept for optional or heavy dependencies (lm-eval, pandas, wandb, ...) and in
``cli``, so that ``quantdyn -h`` answers without importing torch.
"""

__version__ = "0.1.0"
