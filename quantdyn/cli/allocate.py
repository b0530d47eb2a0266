"""``quantdyn allocate``: a per-tensor quantization plan of one checkpoint under a bits-per-weight budget."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, echo_json
from quantdyn.errors import QuantdynError

DATA, ENGINE, OUTPUT = "Data (the sensitivity windows are the calibration windows)", "Engine", "Output"


@command()
def allocate(
    model: str = typer.Argument(..., help="Local HF dir, quantdyn checkpoint, or hub-id[@revision]."),
    budget: float = typer.Option(..., "--budget", help="Bits per weight over the quantized tensors, counted as result "
                                 "rows count them (scales included), e.g. 4.5."),
    types: str = typer.Option(..., "--types", help="Candidate types, comma-separated: GGUF block types (q3_k, q4_k, "
                              "q5_k, q6_k, q8_0 ... each also -imatrix), integer grids (rtn4, gptq3g64-sym ...), "
                              "fp8, fp8-channel, nf4, mxfp4, nvfp4, f16."),
    out: Path = opt.out(..., "the plan (JSON) to this file; quantize with --quantizers plan:FILE.", kind="file"),
    store: Optional[str] = opt.store(None, "Also store the per-tensor sensitivity rows there.", panel=OUTPUT),
    calib_data: str = typer.Option("builtin:kjv", "--calib-data", help="Any quantdyn data source.", rich_help_panel=DATA),
    calib_samples: int = typer.Option(32, "--calib-samples", help="Sensitivity (calibration) sequences.",
                                      rich_help_panel=DATA),
    calib_seq_len: int = typer.Option(128, "--calib-seq-len", help="Tokens per sequence.", rich_help_panel=DATA),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Default: the model's own tokenizer.",
                                            rich_help_panel=DATA),
    draws: int = typer.Option(2, "--draws", help="Labels drawn from the model per sequence (the sampled Fisher's "
                              "Monte Carlo draws; each adds one backward pass).", rich_help_panel=ENGINE),
    device: str = opt.device("auto", "Blocks are onloaded one at a time.", panel=ENGINE),
    as_json: bool = opt.as_json("the summary as one JSON object"),
    quiet: bool = opt.quiet("No progress lines; the summary and errors only."),
):
    """Allocate bits per tensor under a size budget.

    Measures the checkpoint's sensitivity to every candidate type per tensor (engine/sensitivity.py: one streamed
    forward and backward pass, no model pass per tensor), then picks the assignment of least predicted KL whose bits
    per weight stay at or under --budget (exact knapsack) and writes it as a plan: --quantizers plan:FILE quantizes
    with it in quantize, sweep, studies and the monitor.
    """
    from quantdyn.sweep.allocate_one import allocate_plan

    if draws < 1:
        raise QuantdynError(f"--draws {draws} must be >= 1")
    res = allocate_plan(model, budget, opt.split_list(types), out=out, calib_data=calib_data,
                        n_calib_samples=calib_samples, calib_seq_len=calib_seq_len, tokenizer=tokenizer, store=store,
                        device=device, draws=draws, progress=not (as_json or quiet),
                        echo=lambda line: typer.echo(line, err=True))
    s = res.summary
    if as_json:
        echo_json(s)
        return
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(s["counts"].items()))
    typer.echo(f"plan {out} ({s['allocator']}): {s['bits_per_weight']:.4f} bits per weight (budget {budget:g}; "
               f"reachable {s['budget_range'][0]:.3f}..{s['budget_range'][1]:.3f}); {counts}")
    if s["uniform"]:
        end = "cheapest" if budget <= s["budget_range"][0] + 1e-9 else "richest"
        typer.echo(f"  the budget is the {end} assignment, so the plan is {s['uniform']} everywhere: nothing was "
                   f"allocated; give a --budget inside {s['budget_range'][0]:.3f}..{s['budget_range'][1]:.3f} to "
                   "choose between the types")
    typer.echo(f"  predicted KL(FP||Q) {s['predicted_kl']:.3g} nats/token (tensors alone, summed); with their "
               f"interactions {s['predicted_kl_joint']:.3g} ± {s['predicted_kl_joint_se']:.2g}")
    typer.echo("  uniform types, predicted: " + ", ".join(f"{k} {v:.3g}" for k, v in s["uniform_predicted_kl"].items()))
    rc = s["rank_correlations"]
    typer.echo(f"  proxies' Spearman with the estimate: layer loss {_num(rc.get('layer_loss'))}, diagonal Fisher "
               f"{_num(rc.get('fisher_diag'))} (sensitivity pass {s['sensitivity_seconds']:.1f}s, "
               f"{s['sensitivity_tokens']} tokens x {s['draws']} draws)")
    if s["llama_quantize_script"]:
        n = s["llama_quantize"].count("--tensor-type")
        typer.echo(f"  llama.cpp: sh {s['llama_quantize_script']} MODEL-F32.gguf OUT.gguf  (llama-quantize with "
                   f"{n} --tensor-type arguments, one per tensor)")
    typer.echo(f"  quantize with: --quantizers plan:{out}")


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"
