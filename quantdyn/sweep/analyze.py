"""`quantdyn analyze`: loss-landscape, outlier, error-propagation and early-warning metrics
of checkpoints, written as result rows beside the PTQ error."""
from __future__ import annotations

from pathlib import Path

from quantdyn.config import from_dict
from quantdyn.results.schema import ANALYSIS
from quantdyn.results.store import ResultStore
from quantdyn.runs import RunDir
from quantdyn.sweep.sweep import SweepConfig, run_sweep


def analyze(
    checkpoints: list[str], metrics: list[str], quantizers: list[str], store: str = "results",
    data: dict | None = None, budget: dict | None = None, progress: bool = True, device: str = "auto",
) -> list[dict]:
    """Compute ``metrics`` for each checkpoint (a run directory expands to its checkpoints); return the rows."""
    rows: list[dict] = []
    for ck in checkpoints:
        traj = {"run": ck} if RunDir(ck).is_run else {"checkpoints": [ck]}
        cfg = from_dict(SweepConfig, {"trajectory": traj, "quantizers": [], "analysis": list(metrics),
                                      "propagation_quantizers": list(quantizers), "store": store,
                                      "data": data or {}, "analysis_budget": budget or {}, "device": device})
        run_sweep(cfg, progress=progress)
    wanted = {str(Path(c).resolve()) for c in checkpoints}
    for r in ResultStore(store).rows():
        if not ANALYSIS.matches(r):
            continue
        p = Path(r["checkpoint"]).resolve()
        if str(p) in wanted or any(str(p).startswith(w + "/") for w in wanted):
            rows.append(r)
    return rows
