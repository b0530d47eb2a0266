"""``quantdyn quantize``: quantize one model with one or more quantizers and measure each against full precision."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, deprecated, echo_json
from quantdyn.errors import QuantdynError

QUANTIZER, DATA, OUTPUT, ENGINE = "Quantizer", "Data", "Output", "Engine"
FLAGS = {"quantizers": "--quantizers", "out": "--out", "export": "--export", "export_options": "--export-option",
         "push_to_hub": "--push-to-hub", "repeats": "--repeats", "eval_tokens": "--eval-tokens",
         "eval_seq_len": "--eval-seq-len", "calib_samples": "--calib-samples"}
"""The flags quantize_one's request checks name in their errors."""


@command()
def quantize(
    model: str = typer.Argument(..., help="Local HF dir, quantdyn checkpoint, or hub-id[@revision]."),
    quantizers: Optional[str] = opt.quantizers(None, "Several are measured in one pass (one FP forward); "
                                               "--out takes one. [default: gptq4]", panel=QUANTIZER),
    method: Optional[str] = typer.Option(None, "--method", help="The quantizer as long flags instead of a label: "
                                         "rtn | gptq | awq [default: gptq]", rich_help_panel=QUANTIZER),
    bits: Optional[int] = typer.Option(None, "--bits", help="2..8 [default: 4]", rich_help_panel=QUANTIZER),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Input columns per scale; 0 = one group per "
                                             "row [default: 128]", rich_help_panel=QUANTIZER),
    preset: Optional[str] = typer.Option(None, "--preset", hidden=True,
                                         help="Old spelling of a label's preset (--quantizers gptq4-gptqmodel)."),
    repeats: int = typer.Option(1, "--repeats", help="Quantize R times per quantizer with different calibration "
                                "draws: mean, SD over repeats, combined uncertainty.", rich_help_panel=QUANTIZER),
    repeat_vary: str = typer.Option("draw", "--repeat-vary", help="What differs between repeats: draw | order | both.",
                                    rich_help_panel=QUANTIZER),
    calib_data: str = typer.Option("builtin:kjv", "--calib-data", help="Any quantdyn data source.", rich_help_panel=DATA),
    calib_samples: int = opt.config_option(opt.DATA_CONFIG, "calib_samples", 32, panel=DATA),
    calib_seq_len: int = opt.config_option(opt.DATA_CONFIG, "calib_seq_len", 128, panel=DATA),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Default: same as --calib-data.",
                                            rich_help_panel=DATA),
    eval_tokens: int = typer.Option(25600, "--eval-tokens", help="Held-out tokens for the error.", rich_help_panel=DATA),
    eval_seq_len: int = opt.config_option(opt.DATA_CONFIG, "eval_seq_len", 128, panel=DATA),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Default: the model's own tokenizer.",
                                            rich_help_panel=DATA),
    out: Optional[Path] = opt.out(None, "the fake-quantized model and its codes (or --export) to this directory.",
                                  panel=OUTPUT, kind="new-dir"),
    save: Optional[Path] = typer.Option(None, "--save", hidden=True, help="Old spelling of --out.",
                                        callback=opt.writable("new-dir")),
    export: Optional[str] = typer.Option(None, "--export", help="Write --out as a deployable checkpoint: gptq | "
                                         "compressed-tensors | gguf (one .gguf file for llama.cpp; with a GGUF "
                                         "quantizer such as q4_k_m).", rich_help_panel=OUTPUT),
    export_option: Optional[List[str]] = typer.Option(None, "--export-option", help="KEY=VALUE option of the export "
                                                      "format (repeatable): checkpoint_format=gptq_v2, "
                                                      "scale_dtype=float16.", rich_help_panel=OUTPUT),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="Upload the export to this hub repo (needs "
                                              "a token).", rich_help_panel=OUTPUT),
    device: str = opt.device("auto", "Blocks are onloaded one at a time.", panel=ENGINE),
    dtype: str = opt.config_option(opt.ENGINE_CONFIG, "dtype", "auto", panel=ENGINE),
    max_memory: str = opt.config_option(opt.ENGINE_CONFIG, "max_memory", "", panel=ENGINE),
    threads: int = opt.config_option(opt.ENGINE_CONFIG, "quantize_threads", 1, "--threads", panel=ENGINE),
    layer_diagnostics: bool = opt.config_option(opt.ENGINE_CONFIG, "layer_diagnostics", False, panel=ENGINE),
    as_json: bool = typer.Option(False, "--json", help="Print each quantizer's result row as one JSON object per "
                                 "line instead of the table."),
    quiet: bool = opt.quiet("No progress lines; the result table and errors only."),
):
    """Quantize a model and measure Δ CE, KL and agreement.

    The quantizer is a label (--quantizers gptq3, several in one pass: --quantizers gptq3,rtn4) or the long
    flags --method/--bits/--group-size (one of the two, not both).
    """
    from quantdyn.quantize.catalogue import parse_quantizer, quant_preset  # no torch: a bad quantizer is one quick line

    if save is not None:
        if out is not None and out != save:
            raise QuantdynError("give the output directory once: --out (--save is its old spelling)")
        deprecated("quantize --save", "use --out")
        out = save
    long_flags = [f for f, v in (("--method", method), ("--bits", bits), ("--group-size", group_size),
                                 ("--preset", preset)) if v is not None]
    if quantizers is not None and long_flags:
        raise QuantdynError(f"give the quantizer once: --quantizers LABELS or {'/'.join(long_flags)}, not both")
    if quantizers is not None:
        qcs = [parse_quantizer(q) for q in opt.split_quantizers(quantizers)]
        if not qcs:
            raise QuantdynError("--quantizers is empty; give labels such as gptq3 or gptq3,rtn4")
    else:
        fields = {"method": method or "gptq", "bits": 4 if bits is None else bits,
                  "group_size": 128 if group_size is None else group_size}
        qcs = [quant_preset(preset, **fields) if preset else parse_quantizer(fields)]
        if preset:
            deprecated("quantize --preset", f"write the preset into the label: --quantizers {qcs[0].name}")
    options = _export_options(export_option)
    from quantdyn.engine.measure import MeasureConfig
    from quantdyn.sweep.quantize_one import check_request, quantize_one

    check_request(qcs, out=out, export=export, export_options=options, push_to_hub=push_to_hub, repeats=repeats,
                  eval_tokens=eval_tokens, eval_seq_len=eval_seq_len, calib_samples=calib_samples, names=FLAGS)
    result = quantize_one(model, qcs, calib_data=calib_data, calib_samples=calib_samples,
                          calib_seq_len=calib_seq_len, eval_data=eval_data, eval_tokens=eval_tokens,
                          eval_seq_len=eval_seq_len, tokenizer=tokenizer, out=out, export=export,
                          export_options=options, push_to_hub=push_to_hub, device=device,
                          measure_cfg=MeasureConfig(quantize_threads=threads, dtype=dtype, max_memory=max_memory,
                                                    layer_diagnostics=layer_diagnostics),
                          repeats=repeats, repeat_vary=repeat_vary, progress=not (as_json or quiet),
                          fit_group=_group_unspelled(quantizers, group_size))
    if as_json:
        for row in result.rows:
            echo_json({k: v for k, v in row.items() if k not in ("window_delta", "window_kl")})
        return
    for row in result.rows:
        _print_row(model, row, eval_seq_len)
    first = result.rows[0] if result.rows else {}
    if first.get("weight_grid"):  # one checkpoint: said once, whatever the number of quantizers
        from quantdyn.analysis.grid import grid_note

        typer.echo(f"note: {grid_note(first['weight_grid_levels'], first['weight_grid'])}")
    if out is not None and result.row.get("export", {}).get("fitted"):
        typer.echo(f"compressed-tensors: {result.row['export']['fitted']}")
    if out is not None:
        typer.echo(f"{'exported (' + export + ')' if export else 'saved'}: {out}"
                   + (f" and pushed to {result.row['export']['hub']}" if push_to_hub else ""))


def _group_unspelled(quantizers: Optional[str], group_size: Optional[int]) -> bool:
    """Whether the (first) quantizer's group size is a default rather than the user's choice: no --group-size with
    the long flags, or a label whose first part does not spell one (gptq4, not gptq4g128)."""
    import re

    if quantizers is None:
        return group_size is None
    from quantdyn.cli.options import split_quantizers

    first = (split_quantizers(quantizers) or [""])[0]
    return re.fullmatch(r"[a-z]+\d+", re.split(r"[-+:@]", first, maxsplit=1)[0]) is not None


def _export_options(items: Optional[List[str]]) -> dict[str, str]:
    options = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise QuantdynError(f"--export-option '{item}' must look like KEY=VALUE, e.g. checkpoint_format=gptq_v2")
        options[key.strip()] = value.strip()
    return options


def _print_row(model: str, row: dict, eval_seq_len: int) -> None:
    import math

    typer.echo(f"model {model}  quantizer {row['quantizer']}  ({row['n_windows']} windows x {eval_seq_len} tokens)")
    typer.echo(f"  {'':<12}{'FP':>10}{'quantized':>12}{'delta':>12}")
    typer.echo(f"  {'CE (nats)':<12}{row['ce_fp']:>10.4f}{row['ce_q']:>12.4f}{row['delta_ce']:>+12.4f}  "
               f"± {row['delta_ce_total_se']:.4f}")
    if row["quant_repeats"] > 1:
        typer.echo(f"  {row['quant_repeats']} quantizations ({row['repeat_vary']}): SD over repeats "
                   f"{row['delta_ce_run_sd']:.4f}, evaluation SE {row['delta_ce_se']:.4f}; the "
                   f"{row['uncertainty_dominant']} dominate(s) the uncertainty")
    typer.echo(f"  {'perplexity':<12}{math.exp(row['ce_fp']):>10.3f}{math.exp(row['ce_q']):>12.3f}"
               f"{row['delta_ppl']:>+12.3f}")
    typer.echo(f"  KL(FP||Q) {row['kl']:.5f} nats/token   top-1 agreement {row['top1_agree']:.4f}   "
               f"quantize {row['t_quantize']:.1f}s")

