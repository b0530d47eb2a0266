"""``quantdyn analyze``: Hessian, outlier and error-propagation metrics of checkpoints -> result rows."""
from __future__ import annotations

from typing import List

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, echo_json


@command()
def analyze(
    checkpoints: List[str] = typer.Argument(..., help="Checkpoint directories or run directories."),
    metrics: str = typer.Option("hessian,outliers,propagation", "--metrics",
                                help="Comma-separated analyses: hessian, outliers, propagation, curvature (the early warning)."),
    quantizers: str = opt.quantizers("gptq3,rtn4", "Used by the propagation analysis."),
    store: str = opt.store("results"),
    windows: int = typer.Option(8, "--windows", help="Windows per analysis (held-out / calibration)."),
    probes: int = typer.Option(50, "--probes", help="Hutchinson probe budget."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per window."),
    device: str = opt.device("auto"),
    as_json: bool = opt.as_json(),
    quiet: bool = opt.quiet("No progress; the rows and errors only."),
):
    """Measure sharpness, outliers and error propagation.

    Hessian trace and top eigenvalue, weight and activation outlier metrics, and paper B's error propagation;
    the rows go to the store."""
    from quantdyn.sweep.analyze import analyze as run_analyze

    rows = run_analyze(checkpoints, opt.split_list(metrics), opt.split_quantizers(quantizers),
                       store=store, budget={"windows": windows, "hessian_probes": probes},
                       data={"calib_seq_len": seq_len, "eval_seq_len": seq_len, "eval_windows": max(windows, 8),
                             "calib_samples": max(windows, 8)}, progress=not quiet, device=device)
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        vals = {k: v for k, v in r.items() if v is not None
                and k.startswith(("hessian_", "weight_", "act_", "prop_", "curvature_", "update_"))
                and k not in ("weight_decay", "curvature_from_hash")}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(vals.items())[:8])
        typer.echo(f"{r['checkpoint']} [{r['analysis']}] {shown}")
    typer.echo(f"{len(rows)} analysis rows in {store}")
