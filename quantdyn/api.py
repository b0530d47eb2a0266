"""quantdyn's public Python API: what scripts, notebooks and other tools import.

``import quantdyn.api as qd``.  These names keep their meaning across versions; everything else under
``quantdyn.*`` is internal and may move.  (They are not attributes of the ``quantdyn`` package itself:
``quantdyn.engine.measure`` and ``quantdyn.train`` are subpackages.)

Quantize and measure (a quantizer is a label such as "gptq3", "rtn4g64", "gptq4-gptqmodel", or a QuantConfig)
    parse_quantizer("gptq3")      -> QuantConfig (labels such as gptq4g128, rtn3, awq4, or a dict)
    measure(ckpt, ["gptq3", "rtn4"], eval_windows, calib_ids) -> Measurement (.metrics[label]: Δ CE ± SE,
                                     KL, agreement), streamed one decoder block at a time (MeasureConfig);
                                     eval_windows [N, T+1] and calib_ids [N, L] are token-id tensors
    quantize_checkpoint(ref, "gptq3", out=None, export=None) -> QuantizeResult (.row, .rows, .metrics[label],
                                     .out): the `quantdyn quantize` command as a call; several quantizers
                                     are measured in one pass; out/export write the model of one
    quantize_model(model, calib_ids, cfg) -> the quantized layers, the model changed in place
    load_causal_lm(ref) / load_gpt(dir) / save_hf(model, dir)
Train and monitor
    DataConfig, prepare_data(cfg) -> TokenData (token shards; .eval_windows(seq_len, n), .calib_windows(n, seq_len))
    RunConfig, load_run_config(dir), train(cfg, hooks=hooks_for(cfg)) -> run dir
    cooldown(run_dir, from_step, [decay_steps], control=True) -> branch dirs
    cooldown_from_checkpoint(cfg, out, [decay_steps], control=True) -> branch dirs of cfg.model.hf (any HF causal
                                     LM: a directory, hub id@revision), the branch point as step 0 of each
    PTQMonitor(["rtn4", "gptq3"], eval_ids=..., calib_ids=..., every=N).step(model, step, lr)
Sweep, study, results, report
    SweepConfig, run_sweep(cfg); StudySpec, load_study_spec(path), run_study(spec)
    ResultStore(path).rows(); load_results(store) -> pandas.DataFrame; to_parquet(store, path)
    write_report(store_or_run_dir, out_dir)  -> index.html, opening with the findings' verdicts the rows allow
What to ship
    ship(source, budget=4.5, out="ship/") -> ShipResult (.report: ship.json -- the checkpoint or average and the
                                     quantization to deploy, the options tied with it, the gain over the naive
                                     choice ± SE; .path): `quantdyn ship` as a call; ShipConfig its settings
Configs
    load_yaml(path), apply_overrides(dict, ["a.b=1"]), from_dict(cls, dict)
Errors
    QuantdynError: every user error (one line saying what to fix)

Example::

    import quantdyn.api as qd
    m = qd.measure("runs/tiny/checkpoints/step-0000400", ["gptq3", "rtn4"], eval_windows, calib_ids)
    for label, x in m.metrics.items():
        print(label, x["delta_ce"], x["delta_ce_se"])
"""
from __future__ import annotations

from quantdyn.config import apply_overrides, from_dict, load_yaml
from quantdyn.data.prepare import DataConfig, TokenData, prepare_data
from quantdyn.engine.measure import MeasureConfig, Measurement, measure
from quantdyn.engine.walk import quantize_model
from quantdyn.errors import QuantdynError
from quantdyn.models.hf_io import load_causal_lm, load_gpt, save_hf
from quantdyn.monitor import PTQMonitor, hooks_for
from quantdyn.quantize.catalogue import QuantConfig, parse_quantizer
from quantdyn.results.store import ResultStore
from quantdyn.results.tables import load as load_results
from quantdyn.results.tables import to_parquet
from quantdyn.ship.ship import ShipConfig, ShipResult, ship
from quantdyn.studies.spec import StudySpec, load_study_spec
from quantdyn.sweep.quantize_one import QuantizeResult
from quantdyn.sweep.quantize_one import quantize_one as quantize_checkpoint
from quantdyn.sweep.sweep import SweepConfig, run_sweep
from quantdyn.train.branches import cooldown, cooldown_from_checkpoint
from quantdyn.train.config import RunConfig, load_run_config
from quantdyn.train.trainer import train

__all__ = [
    "DataConfig", "TokenData", "cooldown", "cooldown_from_checkpoint", "prepare_data", "quantize_checkpoint",
    "MeasureConfig", "Measurement", "PTQMonitor", "QuantConfig", "QuantdynError", "QuantizeResult", "ResultStore",
    "RunConfig", "ShipConfig", "ShipResult",
    "StudySpec", "SweepConfig", "apply_overrides", "from_dict", "hooks_for", "load_causal_lm", "load_gpt",
    "load_results", "load_run_config", "load_study_spec", "load_yaml", "measure", "parse_quantizer",
    "quantize_model", "run_study", "run_sweep", "save_hf", "ship", "to_parquet", "train", "write_report",
]


def __getattr__(name: str):
    """run_study and write_report draw figures: they (and matplotlib) are imported when first asked for, so that
    ``import quantdyn.api`` imports no plotting library."""
    if name == "run_study":
        from quantdyn.studies.pipeline import run_study

        return run_study
    if name == "write_report":
        from quantdyn.studies.section import write_report

        return write_report
    raise AttributeError(f"module 'quantdyn.api' has no attribute '{name}'")
