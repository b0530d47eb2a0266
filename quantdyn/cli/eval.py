"""``quantdyn eval``: downstream accuracy (lm-evaluation-harness) of a model and its quantized twins."""
from __future__ import annotations

from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, deprecated, echo_json


@command("eval")
def eval_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory or hub-id[@revision]."),
    tasks: str = typer.Option(..., "--tasks", help="lm-eval tasks, comma-separated (offline: "
                              "quantdyn_lastword,quantdyn_nextsent)."),
    quantizers: Optional[str] = opt.quantizers(None, "[default: none, FP only]"),
    quantizer: Optional[str] = typer.Option(None, "--quantizer", hidden=True, help="Old spelling of --quantizers."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="Few-shot examples per prompt."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Examples per task."),
    seed: int = typer.Option(0, "--seed", help="Seed of the tasks' sampling and the calibration draw."),
    metric: Optional[str] = typer.Option(None, "--metric", help="Default: acc, else acc_norm."),
    backend: str = typer.Option("quantdyn", "--backend", help="quantdyn (in-memory adapter) | hf (lm-eval's HFLM)"),
    store: str = opt.store("results", "'' = don't store."),
    device: str = opt.device("auto"),
    as_json: bool = opt.as_json(),
    quiet: bool = opt.quiet("No progress; the table and errors only."),
):
    """Measure downstream accuracy of FP and quantized models.

    lm-evaluation-harness tasks on the full-precision model and on each quantizer's twin; rows go to the store."""
    from quantdyn.sweep.accuracy import evaluate_accuracy, format_accuracy_table

    if quantizer is not None:
        deprecated("eval --quantizer", "use --quantizers")
    qs = opt.split_list(",".join(x for x in (quantizers, quantizer) if x)) or None
    rows = evaluate_accuracy(model, opt.split_list(tasks), qs, num_fewshot=num_fewshot, limit=limit,
                             seed=seed, metric=metric, backend=backend, progress=not (as_json or quiet), device=device)
    if store:
        from quantdyn.results.store import ResultStore

        ResultStore(store).append(rows)  # rows already stored are skipped
    if as_json:
        echo_json(rows)
        return
    typer.echo(format_accuracy_table(rows))
