"""``quantdyn interpolate``: FP loss and Δ CE along the straight line between two checkpoints."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, echo_json


@command()
def interpolate(
    a: Path = typer.Argument(..., help="Checkpoint at alpha = 0."),
    b: Path = typer.Argument(..., help="Checkpoint at alpha = 1."),
    steps: int = typer.Option(11, "--steps", help="Points on the alpha grid, endpoints included."),
    quantizers: str = opt.quantizers("rtn4"),
    out: Optional[Path] = opt.out(None, "the interpolated checkpoints to this directory [default: "
                                  "RUN_DIR/averages/interp-A-B when A is a run's checkpoint]."),
    store: str = opt.store("results"),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per calibration/evaluation window."),
    eval_windows: int = typer.Option(200, "--eval-windows", help="Held-out windows for the error."),
    device: str = opt.device("auto"),
    as_json: bool = opt.as_json(),
):
    """Measure checkpoints interpolated between two checkpoints.

    At each alpha on the grid, θ = (1-α)·θ_A + α·θ_B: its FP loss and each quantizer's Δ CE; rows go to the store."""
    from quantdyn.results.store import ResultStore
    from quantdyn.sweep.interpolation import interpolate_checkpoints

    rows = interpolate_checkpoints(a, b, steps, quantizers=opt.split_quantizers(quantizers), out=out,
                                   eval_seq_len=seq_len, calib_seq_len=seq_len, eval_windows=eval_windows,
                                   device=device)
    ResultStore(store).append(rows)  # rows already stored are skipped
    if as_json:
        echo_json([{k: v for k, v in r.items() if k != "window_delta"} for r in rows])
        return
    for r in rows:
        typer.echo(f"alpha {r['alpha']:.3f}  {r.get('quantizer', ''):<6} FP {r['ce_fp']:.4f}  "
                   f"ΔCE {r['delta_ce']:+.4f} ± {r['delta_ce_se']:.4f}")
