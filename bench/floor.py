"""The floor: what one measurement must cost at least, measured beside `quantdyn quantize` and `quantdyn sweep` on the
same checkpoint and the same tokens, phase by phase.

    .venv/bin/python bench/floor.py                                   # both shapes, rtn4 and five quantizers
    .venv/bin/python bench/floor.py --shapes llama135m --sets rtn4 --reps 2 --eval-windows 16

The *floor* is a plain transformers script (``--child floor``, its own interpreter): load the checkpoint with
``AutoModelForCausalLM.from_pretrained``; one full-precision forward over the evaluation windows (the decoder, then
the head and the cross-entropy); for each quantizer, the quantizer's own work on every decoder linear at one thread,
as quantdyn calibrates and quantizes by default (``quantize_threads: 1``; the forwards use torch's threads) (RTN: the
``rtn`` function; GPTQ: the reference's sequential calibration — each block's calibration inputs through the block
with hooks that accumulate H, once per input the layers share, then ``gptq`` per layer, then the calibration inputs
through the quantized block — with the same calibration windows) and one forward of the quantized model. It computes
CE only: no KL, no agreement, no per-block maps, no rows written. Against it, in fresh interpreters too:

* ``quantdyn quantize CKPT --quantizers Q --json`` with its defaults (as a user runs it);
* ``quantdyn sweep SPEC`` over the one checkpoint with the same quantizers and data, its defaults (the noise floor
  and the detailed measures on) — and ``--variant`` runs of quantize with options (e.g. ``--layer-diagnostics``).

Runs are interleaved (floor, quantize, sweep, floor, ...) ``--reps`` times, and each figure is the best (least
disturbed) of its runs: the machine is shared, so the ratios are what hold, with the load average beside them.
Goals (issue 40): one quantizer <= 1.3x the floor; five quantizers <= the floor (one FP pass + five quantized
passes + their quantization). The checkpoints are random weights in the real shapes, bf16 safetensors written by
transformers: SmolLM-135M's LLaMA shape (hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocabulary
49,152, tied embeddings) and Pythia-160M's GPT-NeoX shape. Tokens: builtin:kjv with a BPE of ``--tokenizer``,
prepared once by quantdyn's data module and handed to the floor as ids, so all sides see the same windows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

SHAPES = {
    "llama135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0),
    "pythia160m": dict(model_type="gpt_neox", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, vocab_size=50304, rotary_pct=0.25, use_parallel_residual=True,
                       max_position_embeddings=2048, tie_word_embeddings=False),
    # the same code paths in seconds (tests)
    "llama-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
                       max_position_embeddings=256),
    "pythia-tiny": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, vocab_size=4096, rotary_pct=0.25, use_parallel_residual=True,
                        max_position_embeddings=256, tie_word_embeddings=False),
}
SETS = {"rtn4": ("rtn4",), "five": ("gptq3", "gptq4", "rtn2", "rtn3", "rtn4")}
"""--sets: the quantizers measured together (five: what the GPU runbook's sweep step measures)."""
SHAPES_DEFAULT, SETS_DEFAULT = "llama135m,pythia160m", "rtn4,five"


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").is_file() else float("nan")


# ------------------------------------------------------------------ inputs
def write_checkpoint(shape: str, out: Path) -> Path:
    """Random weights in ``shape`` (transformers' own initialisation), saved as bf16 safetensors with its config."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def write_tokens(out: Path, tokenizer: str, eval_windows: int, calib: int, seq: int) -> Path:
    """The evaluation windows and calibration windows `quantize` and `sweep` draw (quantdyn's data module, the
    same cache), saved for the floor."""
    import torch

    from quantdyn.data.prepare import DataConfig, prepare_data
    from quantdyn.engine.rows import calibration_draws

    data = prepare_data(DataConfig(source="builtin:kjv", tokenizer=tokenizer), progress=False)
    torch.save({"eval": data.eval_windows(seq, eval_windows), "calib": calibration_draws(data, calib, seq, 0, 1)[0]},
               out)
    return out


# ------------------------------------------------------------------ the floor (a child process)
LINEARS = {  # the decoder linears of each family, in true-sequential order
    "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"),
    "gpt_neox": ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
}


def floor_child(ckpt: str, tokens: str, quantizers: list[str], dtype: str, eval_batch: int, calib_batch: int,
                threads: int = 1) -> dict:
    t_start = time.perf_counter()
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from quantdyn.quantize.catalogue import parse_quantizer
    from quantdyn.quantize.gptq import gptq, hessian_update
    from quantdyn.quantize.primitives import num_threads
    from quantdyn.quantize.rtn import rtn

    out: dict = {"import_s": time.perf_counter() - t_start}
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    out["load_s"] = time.perf_counter() - t
    ids = torch.load(tokens)
    windows, calib = ids["eval"], ids["calib"]
    base, head = model.base_model, model.get_output_embeddings()
    layers = base.layers
    names = LINEARS[model.config.model_type]

    def evaluate() -> tuple[float, float, float]:
        """(decoder seconds, head seconds, mean CE): the windows' inputs through the model, CE of the next token."""
        t_blocks = t_head = 0.0
        total, n = 0.0, 0
        for batch in windows.split(eval_batch):
            t0 = time.perf_counter()
            h = base(input_ids=batch[:, :-1], use_cache=False).last_hidden_state
            t1 = time.perf_counter()
            logits = head(h).float()
            ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total, n = total + float(ce), n + batch[:, 1:].numel()
            t_blocks, t_head = t_blocks + t1 - t0, t_head + time.perf_counter() - t1
        return t_blocks, t_head, total / n

    def linears(layer):
        return [(n, layer.get_submodule(n)) for n in names]

    with torch.no_grad():
        out["fp_blocks_s"], out["fp_head_s"], out["ce_fp"] = evaluate()
        original = [[m.weight.detach().clone() for _, m in linears(layer)] for layer in layers]
        out["quantizers"] = {}
        for q in quantizers:
            qc = parse_quantizer(q)
            rec = {"calib_s": 0.0, "quantize_s": 0.0}
            one_thread = num_threads(threads)  # as quantdyn calibrates and quantizes (quantize_threads)
            one_thread.__enter__()
            if qc.method == "gptq":
                t0 = time.perf_counter()
                captured = []  # per calibration batch: block 0's hidden states and the other arguments

                def catch(module, args, kwargs):
                    captured.append((args[0] if args else kwargs.pop("hidden_states"),
                                     {k: v for k, v in kwargs.items() if k != "hidden_states"}))
                    raise StopIteration

                hook = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
                for batch in calib.split(calib_batch):
                    try:
                        base(input_ids=batch, use_cache=False)
                    except StopIteration:
                        pass
                hook.remove()
                rec["calib_s"] += time.perf_counter() - t0
                for layer in layers:
                    t0 = time.perf_counter()
                    hs: dict[str, tuple] = {}  # one H per distinct input: q/k/v (and gate/up) share theirs
                    owner: dict[str, str] = {}
                    seen: dict[int, tuple] = {}  # this batch: id(input) -> (input, first layer given it)

                    def add(mod, inp, _out, name):
                        x = inp[0]
                        first = seen.get(id(x))
                        if first is not None and first[0] is x:
                            owner[name] = first[1]
                            return
                        seen[id(x)] = (x, name)
                        owner[name] = name
                        hs[name] = hessian_update(*hs.get(name, (None, 0)), x)

                    handles = [m.register_forward_hook(lambda mod, i, o, n=n: add(mod, i, o, n))
                               for n, m in linears(layer)]
                    for h, kw in captured:
                        layer(h, **kw)
                        seen.clear()
                    for hnd in handles:
                        hnd.remove()
                    rec["calib_s"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    for n, m in linears(layer):
                        res = gptq(m.weight.detach().float(), hs[owner[n]][0], qc)
                        m.weight.copy_(res.weight.to(m.weight.dtype))
                    rec["quantize_s"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    captured = [((lambda o: o[0] if isinstance(o, tuple) else o)(layer(h, **kw)), kw)
                                for h, kw in captured]
                    rec["calib_s"] += time.perf_counter() - t0
                del captured
            else:
                t0 = time.perf_counter()
                for layer in layers:
                    for _, m in linears(layer):
                        m.weight.copy_(rtn(m.weight.detach().float(), qc).weight.to(m.weight.dtype))
                rec["quantize_s"] = time.perf_counter() - t0
            one_thread.__exit__(None, None, None)
            rec["blocks_s"], rec["head_s"], ce_q = evaluate()
            rec["delta_ce"] = ce_q - out["ce_fp"]
            t0 = time.perf_counter()
            for layer, ws in zip(layers, original):
                for (_, m), w in zip(linears(layer), ws):
                    m.weight.copy_(w)
            rec["restore_s"] = time.perf_counter() - t0
            out["quantizers"][q] = rec
    out["total_s"] = time.perf_counter() - t_start
    return out


# ------------------------------------------------------------------ the runs
PHASES = ("load", "capture", "calib_forward", "quantize_layers", "diagnostics", "eval_forward", "head", "other")
"""The columns of the side-by-side table: quantdyn's engine phases (engine/phases.py; load = read + convert), and
``other``: the rest of the command's wall time (interpreter start, imports, data, checkpoint hash, rows)."""


_CPU: list[float] = []  # CPU seconds (user + system) of the last child, read by the callers below


def _run(cmd: list[str], code: str = "") -> tuple[float, str]:
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # another source tree (--before) runs from its own directory: `python -m` puts the working directory first on
    # sys.path, ahead of this tree's editable install
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=code or ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    _CPU[:] = [after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime]
    if r.returncode != 0:
        raise SystemExit(f"floor: {' '.join(cmd[:4])} ... failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return wall, r.stdout


def run_floor(ckpt: Path, tokens: Path, qs: tuple[str, ...], dtype: str, batch: int, calib_batch: int) -> dict:
    wall, stdout = _run([sys.executable, str(HERE / "floor.py"), "--child", "floor", "--ckpt", str(ckpt), "--tokens",
                         str(tokens), "--quantizers", ",".join(qs), "--dtype", dtype, "--batch", str(batch),
                         "--calib-batch", str(calib_batch)])
    f = json.loads(stdout.strip().splitlines()[-1])
    qrec = f["quantizers"].values()
    phases = {"load": f["load_s"], "capture": 0.0,
              "calib_forward": sum(r["calib_s"] for r in qrec), "quantize_layers": sum(r["quantize_s"] for r in qrec),
              "diagnostics": 0.0, "eval_forward": f["fp_blocks_s"] + sum(r["blocks_s"] for r in qrec),
              "head": f["fp_head_s"] + sum(r["head_s"] for r in qrec)}
    phases["other"] = wall - sum(phases.values())
    return {"wall": wall, "phases": phases, "ce_fp": f["ce_fp"],
            "delta_ce": {q: r["delta_ce"] for q, r in f["quantizers"].items()}, "child": f}


def _quantdyn_phases(wall: float, row: dict) -> dict:
    p = {"load": row["t_read"] + row["t_convert"], **{k: row[f"t_{k}"] for k in PHASES[1:-1]}}
    p["other"] = wall - sum(p.values())
    return p


def run_quantize(ckpt: Path, qs: tuple[str, ...], a, extra: list[str], code: str = "") -> dict:
    wall, stdout = _run([sys.executable, "-m", "quantdyn.cli", "quantize", str(ckpt), "--quantizers", ",".join(qs),
                         "--tokenizer", a.tokenizer, "--eval-tokens", str(a.eval_windows * a.seq), "--eval-seq-len",
                         str(a.seq), "--calib-samples", str(a.calib), "--calib-seq-len", str(a.seq), "--device", "cpu",
                         "--json", *extra], code)
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {"wall": wall, "phases": _quantdyn_phases(wall, rows[0]), "ce_fp": rows[0]["ce_fp"],
            "delta_ce": {r["quantizer"]: r["delta_ce"] for r in rows}}


def run_sweep(ckpt: Path, qs: tuple[str, ...], a, work: Path, overrides: dict, code: str = "") -> dict:
    import yaml

    from quantdyn.results.store import ResultStore

    store = Path(tempfile.mkdtemp(prefix="store-", dir=work))
    spec = {"trajectory": {"checkpoints": [str(ckpt)]}, "quantizers": list(qs), "store": str(store), "device": "cpu",
            "data": {"source": "builtin:kjv", "tokenizer": a.tokenizer, "calib_samples": a.calib,
                     "calib_seq_len": a.seq, "eval_windows": a.eval_windows, "eval_seq_len": a.seq}, **overrides}
    path = store.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(spec))
    wall, _ = _run([sys.executable, "-m", "quantdyn.cli", "sweep", str(path)], code)
    rows = [r for r in ResultStore(store).rows() if r.get("kind") == "ptq"]
    return {"wall": wall, "phases": _quantdyn_phases(wall, rows[0]), "ce_fp": rows[0]["ce_fp"],
            "delta_ce": {r["quantizer"]: r["delta_ce"] for r in rows}}


def parse_variants(items: list[str]) -> list[tuple[str, str, object]]:
    """--variant NAME:quantize:ARGS (extra command-line arguments) or NAME:sweep:KEY=VALUE,... (spec keys)."""
    out = []
    for item in items:
        parts = item.split(":", 2)
        if len(parts) != 3 or parts[1] not in ("quantize", "sweep") or not parts[0]:
            raise SystemExit(f"floor: --variant '{item}' must look like NAME:quantize:ARGS or NAME:sweep:KEY=VALUE,...")
        name, kind, spec = parts
        if kind == "quantize":
            out.append((name, kind, spec.split()))
        else:
            import yaml

            out.append((name, kind, {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in spec.split(","))}))
    return out


def measure_set(shape: str, ckpt: Path, tokens: Path, qs: tuple[str, ...], a, work: Path, variants) -> dict:
    from quantdyn.engine.lazy_model import auto_compute_dtype

    import torch

    dtype = str(auto_compute_dtype(torch.bfloat16, torch.device("cpu"))).replace("torch.", "")
    sides = {"floor": lambda: run_floor(ckpt, tokens, qs, dtype, a.batch, a.calib_batch),
             "quantize": lambda: run_quantize(ckpt, qs, a, [])}
    if not a.no_sweep:
        sides["sweep"] = lambda: run_sweep(ckpt, qs, a, work, {})
    for name, kind, spec in variants:
        sides[name] = ((lambda spec=spec: run_quantize(ckpt, qs, a, spec)) if kind == "quantize"
                       else (lambda spec=spec: run_sweep(ckpt, qs, a, work, spec)))
    if a.before:  # the same commands from another source tree (e.g. the commit before a change), interleaved
        sides["quantize@before"] = lambda: run_quantize(ckpt, qs, a, [], a.before)
        if not a.no_sweep:
            sides["sweep@before"] = lambda: run_sweep(ckpt, qs, a, work, {}, a.before)
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for rep in range(a.reps):
        for name, fn in sides.items():
            load0 = loadavg()
            r = fn()
            r["load"], r["cpu"] = [load0, loadavg()], _CPU[0]
            runs[name].append(r)
            print(f"  {shape} {'+'.join(qs)} rep {rep + 1} {name:>10}: {r['wall']:7.1f} s  (load {load0:.1f})",
                  flush=True)
    best = {k: min(v, key=lambda r: r["wall"]) for k, v in runs.items()}
    cpu = {k: min(r["cpu"] for r in v) for k, v in runs.items()}
    return {"shape": shape, "quantizers": list(qs), "dtype": dtype, "runs": runs, "best": best,
            "ratio": {k: b["wall"] / best["floor"]["wall"] for k, b in best.items()}, "cpu": cpu,
            "cpu_ratio": {k: c / cpu["floor"] for k, c in cpu.items()}}


def table(res: dict) -> list[str]:
    sides = list(res["best"])
    lines = [f"{res['shape']}, {'+'.join(res['quantizers'])} ({res['dtype']}): seconds, best of "
             f"{len(res['runs']['floor'])} interleaved runs",
             f"{'phase':<16}" + "".join(f"{s:>12}" for s in sides)]
    for ph in PHASES:
        lines.append(f"{ph:<16}" + "".join(f"{res['best'][s]['phases'][ph]:12.1f}" for s in sides))
    lines.append(f"{'wall':<16}" + "".join(f"{res['best'][s]['wall']:12.1f}" for s in sides))
    lines.append(f"{'x floor':<16}" + "".join(f"{res['ratio'][s]:12.2f}" for s in sides))
    lines.append(f"{'CPU s':<16}" + "".join(f"{res['cpu'][s]:12.1f}" for s in sides))
    lines.append(f"{'CPU x floor':<16}" + "".join(f"{res['cpu_ratio'][s]:12.2f}" for s in sides))
    lines.append(f"{'CE fp':<16}" + "".join(f"{res['best'][s]['ce_fp']:12.4f}" for s in sides))
    for q in res["quantizers"]:
        lines.append(f"{'dCE ' + q:<16}" + "".join(f"{res['best'][s]['delta_ce'][q]:12.4f}" for s in sides))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES_DEFAULT, help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--sets", default=SETS_DEFAULT, help="quantizer sets: rtn4 (alone), five (gptq3,gptq4,rtn2,rtn3,"
                    "rtn4), or labels joined by '+'")
    ap.add_argument("--eval-windows", type=int, default=32, help="evaluation windows (4,096 tokens at 128, as the "
                    "issue measured)")
    ap.add_argument("--calib", type=int, default=32, help="calibration windows (quantize's default)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="evaluation windows per forward (quantdyn's default)")
    ap.add_argument("--calib-batch", type=int, default=8, help="calibration windows per forward (quantdyn's default)")
    ap.add_argument("--tokenizer", default="bpe:8192")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-sweep", action="store_true", help="floor and quantize only")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:quantize:ARGS or NAME:sweep:KEY=VALUE,... measured beside the defaults (repeatable)")
    ap.add_argument("--before", default="", help="a quantdyn source tree (e.g. `git archive COMMIT | tar -x -C DIR`): "
                    "its quantize and sweep run beside this tree's, interleaved (before/after a change)")
    ap.add_argument("--work", default="", help="checkpoints and tokens (default: a temporary directory)")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/floor-<machine>-<date>.json)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, rtn4, 1 repetition, 8 windows (a smoke run)")
    # the floor itself, in a child process
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", default="", help=argparse.SUPPRESS)
    ap.add_argument("--quantizers", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child == "floor":
        print(json.dumps(floor_child(a.ckpt, a.tokens, a.quantizers.split(","), a.dtype, a.batch, a.calib_batch,
                                     a.threads)))
        return 0
    if a.quick:  # tiny shapes (unless others are named), one repetition, 8 windows
        if a.shapes == SHAPES_DEFAULT:
            a.shapes = "llama-tiny,pythia-tiny"
        if a.sets == SETS_DEFAULT:
            a.sets = "rtn4"
        a.reps, a.eval_windows, a.calib = 1, 8, 8
        a.tokenizer = "bpe:1024"  # the tiny shapes have 4,096 tokens
    shapes = [s for s in a.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"floor: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    sets = [SETS.get(s) or tuple(s.split("+")) for s in a.sets.split(",") if s]
    variants = parse_variants(a.variant)
    from common import record, write_results

    results = {"args": vars(a), "cases": [], "load_start": loadavg()}
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokens = write_tokens(work / f"tokens-{a.tokenizer.replace(':', '')}-{a.eval_windows}-{a.calib}-{a.seq}.pt",
                              a.tokenizer, a.eval_windows, a.calib, a.seq)
        for shape in shapes:
            ckpt = write_checkpoint(shape, work / shape)
            for qs in sets:
                res = measure_set(shape, ckpt, tokens, qs, a, work, variants)
                results["cases"].append(res)
                print("\n".join(table(res)) + "\n", flush=True)
                path = write_results("floor", results, a.out)  # after every case: a cut run keeps what it measured
    results["load_end"] = loadavg()
    if path is not None:
        path = write_results("floor", results, path)
        print(f"written: {path}")
    record("floor", {f"{c['shape']}:{'+'.join(c['quantizers'])}": {"wall": c["ratio"], "cpu": c["cpu_ratio"]}
                     for c in results["cases"]}, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
