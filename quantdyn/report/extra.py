"""Report sections that appear when their rows exist in the store."""
from __future__ import annotations

from pathlib import Path

from quantdyn.report import error_maps, sensitivity_maps
from quantdyn.report.accuracy import accuracy_vs_dce
from quantdyn.report.optimizers import optimizer_figure, optimizer_table, scaling_figure
from quantdyn.report.predictors import predictor_figure, predictor_rows


def sections(rows: list[dict], out: Path) -> list[tuple[str, str, list[dict], str]]:
    found = []
    if any(r.get("kind") == "analysis" for r in rows):
        corr = predictor_rows(rows)
        png = out / "predictors.png"
        if corr and predictor_figure(rows, corr, png):
            found.append((
                "Which metric predicts the quantization error?", png.name, corr,
                ("Spearman and Pearson correlation (95 % bootstrap intervals) of each stored metric with Δ CE across "
                "the checkpoints of this study, per quantizer; scatter plots of the strongest. Paper B finds "
                "outlier metrics (MMR, kurtosis) fail across optimizers while the propagated error R_L predicts; "
                "paper A links Δ CE to the Hessian trace and top eigenvalue."),
            ))
    if any(r.get("kind") == "accuracy" for r in rows):
        png = out / "accuracy_vs_dce.png"
        table = accuracy_vs_dce(rows, png)
        if table:
            found.append(("Downstream accuracy drop against Δ CE", png.name, table,
                          ("Accuracy of the quantized model minus the full-precision one, per task, against Δ CE "
                          "across checkpoints (paper A, Figure 4).")))
    if len({r.get("optimizer") for r in rows if r.get("optimizer")}) > 1 or any(r.get("kind") == "qat" for r in rows):
        table = optimizer_table(rows)
        png = out / "optimizers.png"
        if table and optimizer_figure(table, png):
            found.append(("Optimizers under quantization", png.name, table,
                          ("Per run's final checkpoint: FP loss, PTQ Δ CE per quantizer, the deployed QAT loss, "
                          "outlier metrics (MMR, kurtosis) and the propagated error R_L (paper B).")))
    if any(r.get("kind") == "scaling" for r in rows):
        png = out / "scaling.png"
        table = scaling_figure(rows, png)
        if table:
            found.append(("Scaling laws per optimizer, full precision and QAT", png.name, table,
                          ("L(N, D) = A(ρN)^-α + B·D^-β + E fitted to FP points, then ρ alone to QAT points; ρ < 1 is "
                          "the parameter efficiency lost under quantization (paper B).")))
    found += error_maps.sections(rows, out)
    found += sensitivity_maps.sections(rows, out)
    return found
