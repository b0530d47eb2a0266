"""``quantdyn check-export EXPORT --checkpoint CKPT``: does an export compute the CE quantdyn measured?"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command

DATA, ENGINE = "Data", "Engine"


@command("check-export")
def check_export_cmd(
    export: Path = typer.Argument(..., help="What quantdyn quantize --export wrote: a GPTQ or compressed-tensors "
                                  "directory, or a .gguf file."),
    checkpoint: str = typer.Option(..., "--checkpoint", help="The checkpoint the export was made from (local HF "
                                   "dir, quantdyn checkpoint, RUN@latest or hub-id[@revision])."),
    calib_data: str = typer.Option("builtin:kjv", "--calib-data", help="As given to quantize: a calibrated "
                                   "quantizer (GPTQ, AWQ) is re-measured on the same draw.", rich_help_panel=DATA),
    calib_samples: int = opt.config_option(opt.DATA_CONFIG, "calib_samples", 32, panel=DATA),
    calib_seq_len: int = opt.config_option(opt.DATA_CONFIG, "calib_seq_len", 128, panel=DATA),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Default: same as --calib-data.",
                                            rich_help_panel=DATA),
    eval_tokens: int = typer.Option(4096, "--eval-tokens", help="Held-out tokens both CEs are computed on.",
                                    rich_help_panel=DATA),
    eval_seq_len: int = opt.config_option(opt.DATA_CONFIG, "eval_seq_len", 128, panel=DATA),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Default: the checkpoint's own tokenizer.",
                                            rich_help_panel=DATA),
    device: str = opt.device("auto", panel=ENGINE),
    quiet: bool = opt.quiet("No progress lines; the comparison and the verdict only."),
):
    """Check that an export computes the CE quantdyn measured.

    The export names its quantizer (quantdyn_export.json; the GGUF key quantdyn.quantizer). It is loaded as it is
    served -- transformers (compressed-tensors, its rotation applied for +had; GPTQ also needs optimum and
    GPTQModel) or llama-cpp-python (GGUF) -- and its CE is compared window by window with quantdyn's measurement of
    that quantizer on the checkpoint (same windows, same calibration draw as quantize with the same data options).
    It agrees when the RMS of the per-window difference is at most twice the checkpoint's bf16 noise floor (GGUF:
    plus 25% of the quantizer's Δ CE, for llama.cpp's 8-bit activations).

    Exit status: 0 the export agrees, 1 it does not, 2 a usage error (not an export, a missing package or
    checkpoint, a checkpoint of another shape).
    """
    from quantdyn.sweep.check_export import agrees_exit_code, check_export

    result = check_export(export, checkpoint, calib_data=calib_data, calib_samples=calib_samples,
                          calib_seq_len=calib_seq_len, eval_data=eval_data, eval_tokens=eval_tokens,
                          eval_seq_len=eval_seq_len, tokenizer=tokenizer, device=device, progress=not quiet,
                          echo=lambda line: typer.echo(line, err=True))
    for line in result.lines():
        typer.echo(line)
    code = agrees_exit_code(result)
    if code:
        raise typer.Exit(code)
