"""``quantdyn ship SOURCE --budget BPW --out DIR``: which weights, quantized how, to deploy at a size budget."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import RESUME_HINTS, app, command

RESUME_HINTS["ship"] = "rerun the same command to resume (measured options are kept in the store)"

CANDIDATES, DATA, ENGINE, OUTPUT = "Candidates", "Data", "Engine", "Output"


@command("ship")
def ship_cmd(
    source: List[str] = typer.Argument(..., help="A quantdyn run directory (its branches and averages included; a "
                                       "`quantdyn cooldown MODEL --out DIR` experiment is one), checkpoint "
                                       "directories, or preset:NAME (a public trajectory's last revisions)."),
    budget: float = typer.Option(..., "--budget", help="Bits per weight the quantized linears may take, scales "
                                 "included as each format stores them, e.g. 4.5."),
    out: Path = opt.out(..., "the candidates made (LAWA, soup), plans, the export and ship.json to this directory.",
                        panel=OUTPUT),
    quantizers: Optional[str] = opt.quantizers(None, "Uniform types to consider [default: the common deployment "
                                               "types whose bits per weight on this model fit the budget].",
                                               panel=CANDIDATES),
    formats: Optional[str] = typer.Option(None, "--formats", help="Export formats your engine runs, comma-separated: "
                                          "gguf, gptq, compressed-tensors [default: all].", rich_help_panel=CANDIDATES),
    auto: bool = typer.Option(True, "--auto/--no-auto", help="Also allocate a per-tensor plan auto@BUDGET on each "
                              "candidate.", rich_help_panel=CANDIDATES),
    last: int = typer.Option(2, "--last", help="Last checkpoints of the main run and of each branch.",
                             rich_help_panel=CANDIDATES),
    lawa: int = typer.Option(3, "--lawa", help="LAWA over the last K main-run checkpoints (0: none).",
                             rich_help_panel=CANDIDATES),
    soup: bool = typer.Option(True, "--soup/--no-soup", help="A soup of the decayed branch endpoints.",
                              rich_help_panel=CANDIDATES),
    repeats: int = typer.Option(1, "--repeats", help="Calibration draws per quantization and per sensitivity pass: "
                                "run-to-run spread in every SE, and how stable the allocated plan is.",
                                rich_help_panel=CANDIDATES),
    eval_data: str = typer.Option("", "--eval-data", help="Data source [default: the run's own data, or builtin:kjv "
                                  "with the model's tokenizer].", rich_help_panel=DATA),
    eval_tokens: int = typer.Option(25600, "--eval-tokens", help="Held-out tokens the decision is measured on.",
                                    rich_help_panel=DATA),
    eval_seq_len: int = opt.config_option(opt.DATA_CONFIG, "eval_seq_len", 128, panel=DATA),
    calib_samples: int = opt.config_option(opt.DATA_CONFIG, "calib_samples", 32, panel=DATA),
    calib_seq_len: int = opt.config_option(opt.DATA_CONFIG, "calib_seq_len", 128, panel=DATA),
    screen_windows: int = typer.Option(0, "--screen-windows", help="Windows of the screen (0: a quarter, at least "
                                       "16); as many as --eval-tokens gives: no screen.", rich_help_panel=DATA),
    store: str = opt.store(panel=OUTPUT),
    device: str = opt.device("auto", panel=ENGINE),
    threads: int = opt.config_option(opt.ENGINE_CONFIG, "quantize_threads", 1, "--threads", panel=ENGINE),
    as_json: bool = opt.as_json("ship.json"),
    quiet: bool = opt.quiet(),
):
    """Choose what to deploy at a size budget, and export it.

    Decide which checkpoint or average, quantized how, to deploy at --budget bits per weight, and write it.

    Every candidate x quantization is screened on a few held-out windows; those beaten at z > 2 are dropped (the
    command says which and why) and the rest measured in full. The answer: the best option, the options tied with
    it (|z| <= 2; the smallest file among them is shipped, then the simplest recipe), and the gain over the naive
    choice (the final checkpoint with the uniform type closest to the budget), paired over the same windows.
    """
    from quantdyn.engine.measure import MeasureConfig
    from quantdyn.ship.candidates import CandidateSpec
    from quantdyn.ship.ship import ShipConfig, ship, summary_lines

    cfg = ShipConfig(source=tuple(source), budget=budget, out=str(out), quantizers=tuple(opt.split_quantizers(quantizers)),
                     formats=tuple(opt.split_list(formats)), auto=auto,
                     candidates=CandidateSpec(last=last, lawa=lawa, soup=soup), eval_data=eval_data,
                     eval_tokens=eval_tokens, eval_seq_len=eval_seq_len, calib_samples=calib_samples,
                     calib_seq_len=calib_seq_len, screen_windows=screen_windows, repeats=repeats, store=store,
                     device=device, engine=MeasureConfig(quantize_threads=threads))
    res = ship(cfg, echo=(lambda line: None) if quiet else (lambda line: typer.echo(line, err=True)),
               progress=not quiet)
    if as_json:
        typer.echo(json.dumps(res.report, indent=1, default=str))
        return
    for line in summary_lines(res.report):
        typer.echo(line)
    typer.echo(f"{res.measured} rows measured ({'nothing new: every option was in the store' if not res.measured else store}); "
               f"decision in {res.path}")
