"""Cross-check quantdyn's error measures against llama.cpp's ``llama-perplexity --kl-divergence`` on the same weights.

    make crosscheck-llamacpp          # its own venv (.cache/venv-crosscheck-llamacpp), part of `make crosscheck`
    .cache/venv-crosscheck-llamacpp/bin/python bench/crosscheck_llamacpp.py [--chunks 60] [--checkpoint DIR]

What runs. A small GPT-NeoX (quantdyn's GPT, 4 blocks of width 128, BPE vocabulary of 4096, trained a few hundred
steps on the built-in KJV text; or ``--checkpoint``) is exported by quantdyn's GGUF writer as Q8_0 and Q4_0
(``quantdyn quantize --export gguf``: the bytes llama.cpp's own quantizer writes, tests/test_formats_export.py)
and, as the reference, in F32 (the same file with every linear's full-precision weight). ``llama-perplexity`` is
compiled from the llama.cpp sources of the ``llama-cpp-python`` 0.3.36 sdist against that wheel's own libraries
(one file, seconds; building all of llama.cpp takes ~22 min on 2 cores). It runs the F32 model on KJV text with
``--kl-divergence-base`` (chunks of ``--ctx`` tokens; the second half of each chunk is scored; F32 KV cache, no
flash attention, so that the reference is a plain float32 forward), then each quantized model with
``--kl-divergence``. The tokens it scored are read back from its base file, and quantdyn measures the same tokens.

What is compared, per format (Q8_0, Q4_0), for KL(FP ‖ Q) mean, median, p90, p99, p99.9 and max, "same top p"
(top-1 agreement), the PPL ratio and its logarithm (Δ CE), mean and RMS Δp and the log-probability correlation:

 A. llama.cpp: ``llama-perplexity``'s printed statistics.
 B. llama.cpp's statistics recomputed here from the logits of the same runs (``llama-cpp-python``, same library,
    same settings) and the base file it stored: checks that this script reads the tool right (equal to A to the
    printed digits plus what llama.cpp's float32 arithmetic may move a statistic by: ``float32_bounds``; at CI's
    size the Q8_0 maximum KL, 3.8e-5, was 6.6e-7 off the printed digits without that term).
 C. quantdyn's measures (``evaluate/quant_error.py``, the code behind every row) on llama.cpp's own logits:
    the measures agree when |C − A| is within the STORAGE bound below.
 D. quantdyn's own forward with llama.cpp's two extra roundings emulated (FP and Q alike): ggml's GELU (the tanh
    approximation read from a float16 table, fp16(gelu(fp16(x))), where the checkpoint's GELU is exact) and, as
    ggml's CPU matmuls do for Q8_0/Q4_0 weights, every block linear's input rounded to Q8_0 (blocks of 32, one
    scale each); the weights are the GGUF's (quantdyn's Q8_0/Q4_0 are bit-exact). Agrees within STORAGE + FORWARD.
 E. quantdyn's rows as stored: weight-only fake quantization. This does NOT equal llama.cpp's numbers: ggml
    multiplies Q8_0/Q4_0 weights by Q8_0-rounded activations, which adds its own error (at Q8_0 about as large
    as the weights'); E − D is that activation rounding, reported, not hidden.

Tolerances, derived per token t from the numbers themselves (never fitted to the observed differences):

* STORAGE (A vs C). llama.cpp keeps the reference log-probabilities as uint16 over [max − 16, max]: each is off by
  at most ε_t = scale_t / 2 ≤ 16 / 65535 / 2 = 1.22e-4 nats (scale_t as stored), and tokens whose reference
  log-probability is ≤ −16 are left out of its KL sum. Hence, with p, l the exact reference probabilities and
  log-probabilities and l_q the quantized model's,
      |KL_stored − KL_exact| ≤ (e^ε − 1) Σ_v p |l − l_q| + e^ε ε + Σ_{v: l̃ ≤ −16} p |l − l_q|   =: B_t,
  a mean moves by at most mean_t B_t, a percentile or the maximum by at most max_t B_t; the correct token's
  log-probability by ε_t (ln ratio: mean ε_t; Δp: mean p(y)(e^ε − 1)); the top-1 decision can flip only where
  the two most probable reference tokens are within 2 ε_t: the fraction of such tokens bounds "same top p"; the
  correlation moves by at most 2 max ε_t / SD(ln p(y)) (first order).
* FORWARD (A vs D, on top of STORAGE): quantdyn's float32 forward and ggml's differ in summation order and in
  exp/tanh implementations, and a value exactly at a float16 or Q8_0 rounding boundary may round the other way. Measured per token as
  F_t = max_v |Δ ln q| + max_v |Δ ln p| between llama.cpp's logits and quantdyn's (both normalized); since
  Σ p = 1, a per-token KL moves by at most ~F_t: means by mean_t F_t, percentiles by max_t F_t; the top-1
  agreement by the fraction of tokens whose arg-max differs between the two forwards.

The script exits non-zero when C or D falls outside its tolerance. Results: bench/results/crosscheck_llamacpp-
<machine>-<date>.json and a Markdown table on stdout (BENCHMARKS.md, "Cross-check: llama.cpp").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LLAMA_CPP_PYTHON = "0.3.36"
"""The llama-cpp-python release `make crosscheck-llamacpp` installs (the sdist whose llama.cpp is compiled must be
the installed wheel's: :func:`build_llama_perplexity` refuses another)."""
FORMATS = ("q8_0", "q4_0")
STAT_KEYS = ("kl", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "top1_agree", "ppl_ratio", "ln_ppl_ratio",
             "delta_p", "delta_p_rms", "logprob_corr")


# ------------------------------------------------------------------ llama-perplexity, built against the wheel
def _site_packages_of_llama_cpp() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent.parent


def llama_cpp_source(work: Path, src: Path | None = None) -> Path:
    """The unpacked llama-cpp-python sdist whose ``vendor/llama.cpp`` the installed wheel was built from: ``src`` if
    given, else ``work/src``, pip-downloaded and unpacked there the first time."""
    if src is not None:
        return src
    src = work / "src"
    if not (src / "vendor" / "llama.cpp").is_dir():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)], check=True)
        sdist = next(work.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(work, filter="data")
        (work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}").rename(src)
    return src


def build_llama_tool(work: Path, tool: str, src: Path | None) -> tuple[Path, str]:
    """Compile tools/<tool> (``perplexity``, ``quantize``) of the llama.cpp vendored in the llama-cpp-python sdist
    against the installed wheel's libllama / libllama-common / libggml (the library the Python bindings run): one
    file, seconds. Returns the binary and its ``--version``."""
    from importlib.metadata import version as installed

    if installed("llama_cpp_python") != LLAMA_CPP_PYTHON:
        raise SystemExit(f"llama-cpp-python {installed('llama_cpp_python')} is installed, this script compiles "
                         f"llama-{tool} from {LLAMA_CPP_PYTHON}'s sources: run `make crosscheck-llamacpp`")
    binary = work / f"llama-{tool}"
    site = _site_packages_of_llama_cpp()
    libdirs = [site / "lib", site / "llama_cpp" / "lib"]
    if not binary.exists():
        v = llama_cpp_source(work, src) / "vendor" / "llama.cpp"
        # the tool's own main, plus a flush of llama.cpp's logger, whose queue this llama.cpp leaves unwritten at
        # exit (its common/log.cpp, issue 22142): the final statistics would be lost now and then
        main = work / f"{tool}_main.cpp"
        main.write_text(f'#include "log.h"\nint llama_{tool}(int argc, char ** argv);\n'
                        "int main(int argc, char ** argv) {\n"
                        f"    int rc = llama_{tool}(argc, argv);\n"
                        "    common_log_pause(common_log_main());\n    return rc;\n}\n")
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise SystemExit(f"building llama-{tool} needs a C++ compiler (g++)")
        cmd = [cxx, "-O2", "-std=c++17", f"-I{v / 'common'}", f"-I{v / 'include'}", f"-I{v / 'ggml' / 'include'}",
               f"-I{v / 'vendor'}", str(v / "tools" / tool / f"{tool}.cpp"),
               str(main), "-o", str(binary),
               *[f"-L{d}" for d in libdirs], "-lllama-common", "-lllama", "-lggml", "-lggml-base", "-lpthread",
               "-Wl,--disable-new-dtags," + ",".join(f"-rpath,{d}" for d in libdirs)]
        subprocess.run(cmd, check=True)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stderr.strip()
    return binary, " ".join(version.split())


def build_llama_perplexity(work: Path, src: Path | None) -> tuple[Path, str]:
    """``llama-perplexity``, compiled by :func:`build_llama_tool`."""
    return build_llama_tool(work, "perplexity", src)


# ------------------------------------------------------------------ the model and its GGUF files
def trained_checkpoint(work: Path, steps: int) -> Path:
    """A small GPT-NeoX trained on the built-in KJV text (cached in ``work``)."""
    from quantdyn.config import from_dict
    from quantdyn.runs import list_checkpoints
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    run_dir = work / "run" / "xc"
    if not (run_dir / "checkpoints").is_dir() or not list_checkpoints(run_dir):
        cfg = from_dict(RunConfig, {
            "name": "xc", "out_dir": str(work / "run"),
            "model": {"n_layer": 4, "d_model": 128, "n_head": 4, "max_seq_len": 256, "vocab_size": 4096},
            "data": {"source": "builtin:kjv", "tokenizer": "bpe:4096"},
            "schedule": {"name": "cosine", "warmup": 20},
            "train": {"steps": steps, "batch_size": 16, "seq_len": 128, "eval_every": 0, "eval_windows": 8,
                      "checkpoint_every": steps, "log_every": 50},
        })
        train(cfg, progress=False)
    return Path(list_checkpoints(run_dir)[-1].path)


def export_gguf(ckpt: Path, fmt: str, out: Path) -> Path:
    if not out.exists():
        subprocess.run([sys.executable, "-m", "quantdyn", "quantize", str(ckpt), "--quantizers", fmt, "--export",
                        "gguf", "--out", str(out), "--eval-tokens", "4096"], check=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return out


def _hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> the GPT-NeoX checkpoint's (quantdyn's GGUF writer's naming, inverted)."""
    m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", gguf_name)
    names = {"attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
             "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
    return f"gpt_neox.layers.{m[1]}.{names[m[2]]}.{m[3]}"


def float_gguf(quantized: Path, ckpt: Path, out: Path) -> Path:
    """The reference GGUF: ``quantized``'s metadata and tensors, every quantized linear replaced by its
    full-precision weight in F32 (attn_qkv rows in llama.cpp's [Q; K; V] order, as the writer orders them).
    Each replacement is checked against the quantized tensor it replaces: the dequantized Q8_0 weight is within
    half a step of it in every block, so names and row order cannot be wrong."""
    if out.exists():
        return out
    import gguf
    from safetensors.torch import load_file

    from quantdyn.quantize.gguf import quantize_gguf

    cfg = json.loads((ckpt / "config.json").read_text())
    n_head, d = cfg["num_attention_heads"], cfg["hidden_size"]
    hd = d // n_head
    sd = load_file(str(ckpt / "model.safetensors"))
    reader = gguf.GGUFReader(str(quantized))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = 0 if field.name == "general.file_type" else field.contents()  # 0: all F32
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.array(t.data, dtype=np.float32))
            continue
        W = sd[_hf_name(t.name)].float()
        if ".attn_qkv." in t.name:  # HF (head, q|k|v, dim) rows -> [Q; K; V]
            W = W.view(n_head, 3, hd, -1).transpose(0, 1).reshape(W.shape)
        deq = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type)).reshape(W.shape)
        q8 = quantize_gguf(W, "q8_0") if t.tensor_type == gguf.GGMLQuantizationType.Q8_0 else None
        if q8 is not None and not torch.equal(q8.weight, deq):
            raise SystemExit(f"{t.name}: the F32 weight does not quantize to the file's Q8_0 blocks")
        if q8 is None:  # another type: within its step of the weight
            assert (deq - W).abs().max() <= (W.abs().amax() / 3), t.name
        writer.add_tensor(t.name, W.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# ------------------------------------------------------------------ llama-perplexity's files and output
def kjv_text(path: Path) -> Path:
    from quantdyn.data.sources import kjv_documents

    if not path.exists():
        path.write_text("\n\n".join(kjv_documents()))
    return path


def run_perplexity(binary: Path, model: Path, base: Path, args, text: Path | None) -> str:
    """One llama-perplexity run; its output (also in <model>.log beside the base file). llama.cpp's logger writes
    from a thread of its own and, into a pipe, loses the last lines at exit: its output goes to a file, and a
    --kl-divergence run whose statistics did not all arrive is run again (it is deterministic)."""
    cmd = [str(binary), "-m", str(model), "-c", str(args.ctx), "-b", str(args.ctx), "--chunks", str(args.chunks),
           "-t", str(args.threads), "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--kl-divergence-base", str(base)]
    cmd += ["-f", str(text)] if text is not None else ["--kl-divergence"]
    log = base.with_name(f"{model.stem}.log")
    for _ in range(5):
        with open(log, "w") as f:  # a file, not a pipe: the logger thread keeps up with a file
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
        out = log.read_text()
        if r.returncode != 0:
            raise SystemExit(f"llama-perplexity failed ({r.returncode}): {out[-2000:]}")
        if text is not None or "Same top p" in out:
            return out
    return out


def parse_kl_output(text: str) -> dict:
    """llama-perplexity --kl-divergence's final statistics (percentages as fractions)."""
    def num(label, pct=False):
        m = re.search(re.escape(label) + r"\s*:\s*(-?[\d.]+)", text)
        if m is None:
            raise SystemExit(f"llama-perplexity printed no '{label}'; its output ended:\n{text[-3000:]}")
        return float(m[1]) / (100 if pct else 1)

    return {"kl": num("Mean    KLD"), "kl_median": num("Median  KLD"), "kl_p90": num("90.0%   KLD"),
            "kl_p99": num("99.0%   KLD"), "kl_p999": num("99.9%   KLD"), "kl_max": num("Maximum KLD"),
            "top1_agree": num("Same top p", True), "ppl_ratio": num("Mean PPL(Q)/PPL(base)"),
            "ln_ppl_ratio": num("Mean ln(PPL(Q)/PPL(base))"), "delta_p": num("Mean    Δp", True),
            "delta_p_rms": num("RMS Δp", True), "logprob_corr": num("Cor(ln(PPL(Q)), ln(PPL(base)))", True)}


def read_base_file(path: Path) -> dict:
    """llama-perplexity's --kl-divergence-base file: n_ctx, n_vocab, n_chunk, the tokens, and per scored token the
    reference log-probabilities as stored (uint16 levels, their scale and offset)."""
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_", path
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype=np.uint32).astype(np.int64)
    off = 20
    tokens = np.frombuffer(raw[off: off + 4 * n_ctx * n_chunk], dtype=np.int32).reshape(n_chunk, n_ctx)
    off += 4 * n_ctx * n_chunk
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    body = np.frombuffer(raw[off: off + 2 * nv * n_scored * n_chunk], dtype=np.uint16).reshape(n_chunk, n_scored, nv)
    head = body[..., :4].copy().view(np.float32)  # [scale, min_log_prob] as two float32
    return {"n_ctx": int(n_ctx), "n_vocab": int(n_vocab), "n_chunk": int(n_chunk), "tokens": tokens,
            "levels": body[..., 4: 4 + n_vocab], "scale": head[..., 0], "min_log_prob": head[..., 1]}


# ------------------------------------------------------------------ logits of both tools on the scored tokens
def llama_logits(model: Path, base: dict, args, add_bos: bool) -> np.ndarray:
    """llama.cpp's float32 logits of the scored positions [chunks, scored, vocab] (llama-cpp-python, the same
    library and settings as llama-perplexity)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=args.ctx, n_batch=args.ctx, n_ubatch=args.ctx,
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=True, flash_attn=False,
                          type_k=0, type_v=0, verbose=False)  # type 0: GGML_TYPE_F32 KV cache
    first = args.ctx // 2
    out = []
    for chunk in base["tokens"]:
        ids = chunk.tolist()
        if add_bos:
            ids[0] = llm.token_bos()
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[first: args.ctx - 1], dtype=np.float32))
    del llm
    return np.stack(out)


def add_bos_of(model: Path) -> bool:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    return bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)))


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU as ggml's CPU backend computes it for float32 (ggml-cpu/vec.h, GGML_GELU_FP16): the tanh approximation
    looked up in a float16 table, i.e. fp16(gelu_tanh(fp16(x))), 0 below -10 and x above 10."""
    h = x.half().float()
    g = (0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)))).half().float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, g))


def quantdyn_logits(ckpt: Path, fmt: str | None, base: dict, args, add_bos: bool, ggml_arith: bool) -> np.ndarray:
    """quantdyn's float32 logits of the scored positions: FP (fmt None) or weight-only fake quantization (what rows
    measure); with ``ggml_arith`` the two roundings of ggml's CPU forward that a float32 model does not have are
    emulated: GELU through ggml's float16 table (``ggml_gelu``) and, for a quantized model, every block linear's
    input rounded to Q8_0 (ggml multiplies Q8_0/Q4_0 weights with Q8_0 activations)."""
    from quantdyn.engine.lazy_model import InMemoryModel
    from quantdyn.engine.walk import quantize_model
    from quantdyn.models.gpt import logits_of
    from quantdyn.models.hf_io import load_causal_lm
    from quantdyn.quantize.gguf import quantize_gguf

    model = load_causal_lm(str(ckpt)).float().eval()
    src = InMemoryModel(model)
    if fmt is not None:
        quantize_model(model, None, fmt, progress=False)
    if ggml_arith:
        for block in src.blocks:  # this script's model only: the MLP's GELU through ggml's table
            mlp = block.mlp
            mlp.forward = lambda x, m=mlp: m.dense_4h_to_h(ggml_gelu(m.dense_h_to_4h(x)))
        if fmt is not None:
            def round_q8(mod, inp):
                x = inp[0]
                return (quantize_gguf(x.reshape(-1, x.shape[-1]).float(), "q8_0").weight.reshape(x.shape).to(x.dtype),)
            for block in src.blocks:
                for group in src.adapter.linear_groups(block):
                    for _, lin in group:
                        lin.register_forward_pre_hook(round_q8)
    ids = torch.from_numpy(base["tokens"].astype(np.int64))
    if add_bos:
        ids[:, 0] = int(json.loads((ckpt / "config.json").read_text()).get("bos_token_id") or 0)
    first = args.ctx // 2
    out = []
    with torch.no_grad():
        for x in ids.split(8):
            out.append(logits_of(model, x[:, :-1])[:, first:].float().numpy())
    return np.concatenate(out)


# ------------------------------------------------------------------ the statistics three ways
def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def quantdyn_stats(lf: np.ndarray, lq: np.ndarray, y: np.ndarray) -> dict:
    """quantdyn's measures (evaluate/quant_error.py, as rows compute them) of Q against FP logits."""
    from quantdyn.evaluate.quant_error import ErrorTokens, FPLogits, FPTokens, summarize

    fp_tok, q_tok = FPTokens(), ErrorTokens()
    for a in range(0, len(lf), 4):
        fp = FPLogits(torch.from_numpy(lf[a: a + 4]), torch.from_numpy(y[a: a + 4]))
        fp_tok.add(fp)
        q_tok.add(fp, torch.from_numpy(lq[a: a + 4].copy()))
    s = summarize(fp_tok, q_tok)
    return {**{k: s[k] for k in STAT_KEYS if k in s}, "ln_ppl_ratio": s["delta_ce"]}


def llamacpp_stats(stored: dict, lq: np.ndarray, y: np.ndarray) -> dict:
    """llama.cpp's kl_divergence statistics recomputed from its stored reference and Q's logits (the formulas of
    tools/perplexity/perplexity.cpp: reference log-probabilities decoded from uint16, terms with a reference
    log-probability <= -16 left out, the top-1 token by first maximum, percentiles by linear interpolation)."""
    lev, scale, mlp = stored["levels"], stored["scale"], stored["min_log_prob"]
    lp_base = scale[..., None].astype(np.float32) * lev.astype(np.float32) + mlp[..., None]
    lpq = _log_softmax64(lq)
    keep = lp_base > -16.0
    pb = np.where(keep, np.exp(lp_base.astype(np.float64)), 0.0)
    kl = (pb * (lp_base - lpq)).sum(-1)
    nll = -np.take_along_axis(lpq, y[..., None], -1)[..., 0]
    nll_b = -np.take_along_axis(lp_base, y[..., None], -1)[..., 0].astype(np.float64)
    same = lq.argmax(-1) == lp_base.argmax(-1)
    dp = np.exp(-nll) - np.exp(-nll_b)
    q = lambda f: float(np.quantile(kl, f))  # noqa: E731
    cov = np.mean(nll * nll_b) - nll.mean() * nll_b.mean()
    return {"kl": float(kl.mean()), "kl_median": float(np.median(kl)), "kl_p90": q(0.9), "kl_p99": q(0.99),
            "kl_p999": q(0.999), "kl_max": float(kl.max()), "top1_agree": float(same.mean()),
            "ppl_ratio": math.exp(nll.mean() - nll_b.mean()), "ln_ppl_ratio": float(nll.mean() - nll_b.mean()),
            "delta_p": float(dp.mean()), "delta_p_rms": float(np.sqrt((dp ** 2).mean())),
            "logprob_corr": float(cov / (nll.std() * nll_b.std()))}


PRINTED = {"kl": 5e-7, "kl_median": 5e-7, "kl_p90": 5e-7, "kl_p99": 5e-7, "kl_p999": 5e-7, "kl_max": 5e-7,
           "top1_agree": 5e-6, "ppl_ratio": 5e-7, "ln_ppl_ratio": 5e-7, "delta_p": 5e-6, "delta_p_rms": 5e-6,
           "logprob_corr": 5e-5}
"""Half a unit of the last digit llama-perplexity prints of each statistic (percentages as fractions)."""


def float32_bounds(stored: dict, lq: np.ndarray, ratio: float) -> dict:
    """What llama.cpp's own float32 arithmetic may move each statistic by (added to B's tolerance): its
    kl_divergence (tools/perplexity/perplexity.cpp, log_softmax) rounds the quantized model's log-normalizer
    m = max logit + log Σ exp to float32 and forms every term p (l_base - logit + m) in float32, so a token's KL and
    NLL may be off by a few float32 roundings of those magnitudes: F_t = 2^-23 (|m| + Σ_v p (|l_base| + |logit| + |m|))
    (two roundings of each, p the reference probabilities, Σ p <= 1). Means move by at most mean_t F_t, percentiles
    and the maximum by max_t F_t."""
    lev, scale, mlp = stored["levels"], stored["scale"], stored["min_log_prob"]
    lp_base = (scale[..., None].astype(np.float32) * lev.astype(np.float32) + mlp[..., None]).astype(np.float64)
    lq = lq.astype(np.float64)
    mx = lq.max(-1)
    m = mx + np.log(np.exp(lq - mx[..., None]).sum(-1))
    p = np.where(lp_base > -16.0, np.exp(lp_base), 0.0)
    F = 2.0 ** -23 * (np.abs(m) + (p * (np.abs(lp_base) + np.abs(lq) + np.abs(m)[..., None])).sum(-1))
    mean_f, max_f = float(F.mean()), float(F.max())
    return {"kl": mean_f, "kl_median": max_f, "kl_p90": max_f, "kl_p99": max_f, "kl_p999": max_f, "kl_max": max_f,
            "top1_agree": 0.0, "ppl_ratio": ratio * math.expm1(mean_f), "ln_ppl_ratio": mean_f, "delta_p": 0.0,
            "delta_p_rms": 0.0, "logprob_corr": 0.0}


def _gathered(lp: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.take_along_axis(lp, y[..., None], -1)[..., 0]


def storage_bounds(stored: dict, lf: np.ndarray, lq: np.ndarray, y: np.ndarray, ratio: float) -> dict:
    """The STORAGE tolerance of every statistic (module docstring), from the exact reference logits ``lf`` and the
    scale llama.cpp stored for each token: worst cases, whatever the signs of the rounding errors."""
    eps = stored["scale"].astype(np.float64) / 2
    lp, lpq = _log_softmax64(lf), _log_softmax64(lq)
    p = np.exp(lp)
    dev = np.abs(lp - lpq)
    left_out = (stored["levels"] == 0) | (lp <= -16)  # stored at the floor (below max - 16) or <= -16: not summed
    B = np.expm1(eps) * (p * dev).sum(-1) + np.exp(eps) * eps + (p * dev * left_out).sum(-1)
    p_y = np.exp(_gathered(lp, y))
    top2 = np.sort(lp, -1)[..., -2:]
    dpy = p_y * np.expm1(eps)
    sd = float(-_gathered(lp, y).std())
    mean_b, max_b, ln = float(B.mean()), float(B.max()), float(eps.mean())
    return {"kl": mean_b, "kl_median": max_b, "kl_p90": max_b, "kl_p99": max_b, "kl_p999": max_b, "kl_max": max_b,
            "top1_agree": float(((top2[..., 1] - top2[..., 0]) <= 2 * eps).mean()), "ln_ppl_ratio": ln,
            "ppl_ratio": ratio * math.expm1(ln), "delta_p": float(dpy.mean()),
            "delta_p_rms": float(np.sqrt((dpy ** 2).mean())),
            "logprob_corr": 2 * float(np.sqrt((eps ** 2).mean())) / abs(sd) if sd else math.inf}


def forward_bounds(lf_a: np.ndarray, lf_b: np.ndarray, lq_a: np.ndarray, lq_b: np.ndarray, y: np.ndarray,
                   ratio: float) -> dict:
    """The FORWARD tolerance (module docstring) between forwards a (llama.cpp) and b (quantdyn), per token from
    the identity KL(p'‖q') − KL(p‖q) = Σ (p' − p)(ln p − ln q) + Σ p' ((ln p' − ln p) − (ln q' − ln q))."""
    pa, pb, qa, qb = (_log_softmax64(x) for x in (lf_a, lf_b, lq_a, lq_b))
    F = (np.abs(np.exp(pa) - np.exp(pb)) * np.abs(pb - qb)).sum(-1) + (np.exp(pa) * np.abs((pa - pb) - (qa - qb))).sum(-1)
    d_ln = np.abs(_gathered(qa, y) - _gathered(qb, y)) + np.abs(_gathered(pa, y) - _gathered(pb, y))
    d_p = np.abs(np.exp(_gathered(qa, y)) - np.exp(_gathered(qb, y))) + np.abs(np.exp(_gathered(pa, y))
                                                                              - np.exp(_gathered(pb, y)))
    flips = (lq_a.argmax(-1) != lq_b.argmax(-1)) | (lf_a.argmax(-1) != lf_b.argmax(-1))
    sd = float(_gathered(pb, y).std())
    mean_f, max_f = float(F.mean()), float(F.max())
    return {"kl": mean_f, "kl_median": max_f, "kl_p90": max_f, "kl_p99": max_f, "kl_p999": max_f, "kl_max": max_f,
            "top1_agree": float(flips.mean()), "ln_ppl_ratio": float(d_ln.mean()),
            "ppl_ratio": ratio * math.expm1(float(d_ln.mean())), "delta_p": float(d_p.mean()),
            "delta_p_rms": float(np.sqrt((d_p ** 2).mean())),
            "logprob_corr": 2 * float(np.sqrt((d_ln ** 2).mean())) / sd if sd else math.inf,
            "kl_per_token_mean": mean_f, "kl_per_token_max": max_f}


# ------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / ".cache" / "crosscheck-llamacpp"))
    ap.add_argument("--checkpoint", default="", help="a GPT-NeoX checkpoint directory with tokenizer.json "
                                                    "(default: train one, cached in --work)")
    ap.add_argument("--steps", type=int, default=300, help="training steps of the default model")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per chunk (the second half is scored)")
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-src", default="", help="an unpacked llama-cpp-python sdist (default: pip download)")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/crosscheck_llamacpp-...json)")
    a = ap.parse_args()
    from common import machine, write_results

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    binary, version = build_llama_perplexity(work, Path(a.llama_src) if a.llama_src else None)
    # the model's files apart per model (steps or checkpoint): a run at another size never reuses another's GGUFs
    files = work / (f"steps-{a.steps}" if not a.checkpoint else
                    "checkpoint-" + hashlib.sha1(str(Path(a.checkpoint).resolve()).encode()).hexdigest()[:10])
    files.mkdir(parents=True, exist_ok=True)
    ckpt = Path(a.checkpoint) if a.checkpoint else trained_checkpoint(files, a.steps)
    ggufs = {fmt: export_gguf(ckpt, fmt, files / f"{fmt}.gguf") for fmt in FORMATS}
    f32 = float_gguf(ggufs["q8_0"], ckpt, files / "f32.gguf")
    base_file = files / "base.kld"
    base_out = run_perplexity(binary, f32, base_file, a, kjv_text(work / "kjv.txt"))
    base = read_base_file(base_file)
    if base["n_ctx"] != a.ctx:
        raise SystemExit(f"{base_file}: n_ctx {base['n_ctx']} != --ctx {a.ctx}")
    add_bos = add_bos_of(f32)
    first = a.ctx // 2
    y = base["tokens"][:, first + 1:].astype(np.int64)
    l_llama_fp = llama_logits(f32, base, a, add_bos)
    l_qd_fp = quantdyn_logits(ckpt, None, base, a, add_bos, False)
    l_qd_fp_ggml = quantdyn_logits(ckpt, None, base, a, add_bos, True)
    fp_gap = float(np.abs(_log_softmax64(l_llama_fp) - _log_softmax64(l_qd_fp)).max())
    fp_gap_ggml = float(np.abs(_log_softmax64(l_llama_fp) - _log_softmax64(l_qd_fp_ggml)).max())
    report = {"llama_cpp": version, "llama_cpp_python": LLAMA_CPP_PYTHON, "checkpoint": str(ckpt),
              "n_ctx": a.ctx, "chunks": base["n_chunk"], "scored_tokens": int(y.size), "add_bos": add_bos,
              "threads": a.threads, "loadavg": Path("/proc/loadavg").read_text().split()[:3],
              "fp_forward_max_abs_log_prob_difference": fp_gap,
              "fp_forward_max_abs_log_prob_difference_ggml_gelu": fp_gap_ggml, "formats": {}}
    ok = True
    for fmt, path in ggufs.items():
        printed = parse_kl_output(run_perplexity(binary, path, base_file, a, None))
        l_llama_q = llama_logits(path, base, a, add_bos)
        l_qd_w = quantdyn_logits(ckpt, fmt, base, a, add_bos, False)
        l_qd_wa = quantdyn_logits(ckpt, fmt, base, a, add_bos, True)
        rows = {
            "A llama-perplexity": printed,
            "B llama.cpp formulas on its logits": llamacpp_stats(base, l_llama_q, y),
            "C quantdyn measures on llama.cpp's logits": quantdyn_stats(l_llama_fp, l_llama_q, y),
            "D quantdyn forward, ggml's Q8_0 activations emulated": quantdyn_stats(l_qd_fp_ggml, l_qd_wa, y),
            "E quantdyn rows (weight-only fake quantization)": quantdyn_stats(l_qd_fp, l_qd_w, y),
        }
        st = storage_bounds(base, l_llama_fp, l_llama_q, y, printed["ppl_ratio"])
        fw = forward_bounds(l_llama_fp, l_qd_fp_ggml, l_llama_q, l_qd_wa, y, printed["ppl_ratio"])
        f32 = float32_bounds(base, l_llama_q, printed["ppl_ratio"])
        checks = {}
        for key in STAT_KEYS:
            a_v = printed[key]
            got = {k[0]: v[key] for k, v in rows.items()}
            tol = {"B": PRINTED[key] + f32[key], "C": st[key] + PRINTED[key], "D": st[key] + fw[key] + PRINTED[key]}
            checks[key] = {**{f"{k}_minus_A": got[k] - a_v for k in "BCDE"}, **{f"{k}_tol": t for k, t in tol.items()},
                           **{f"{k}_ok": bool(abs(got[k] - a_v) <= t) for k, t in tol.items()}}
            ok &= all(checks[key][f"{k}_ok"] for k in tol)
        report["formats"][fmt] = {"rows": rows, "checks": checks, "storage_tolerance": st, "forward_tolerance": fw,
                                  "llama_cpp_float32_tolerance": f32}
    report["seconds"] = time.perf_counter() - t0
    path = write_results("crosscheck_llamacpp", report, a.out)
    m = machine()
    print(f"\nllama.cpp cross-check ({m['cpu']}, {time.strftime('%Y-%m-%d')}, llama.cpp {version}, llama-cpp-python "
          f"{LLAMA_CPP_PYTHON}); {y.size} scored tokens ({base['n_chunk']} chunks of {a.ctx}, second halves); "
          f"FP forwards differ by at most {fp_gap:.1e} in any log-probability ({fp_gap_ggml:.1e} with ggml's GELU)")
    for fmt, r in report["formats"].items():
        print(f"\n{fmt}  " + "  ".join(f"{k:>12s}" for k in STAT_KEYS))
        for name, vals in r["rows"].items():
            print(f"  {name[:44]:44s} " + " ".join(f"{vals[k]:12.6g}" for k in STAT_KEYS))
        for k_, name in (("B", "B tolerance (printed + float32)"), ("C", "C tolerance (storage)"),
                         ("D", "D tolerance (storage + forward)")):
            print(f"  {name:44s} " + " ".join(f"{r['checks'][k][k_ + '_tol']:12.2g}" for k in STAT_KEYS))
        print(f"  {'B, C, D within':44s} " + " ".join(
            ",".join(str(r["checks"][k][f"{x}_ok"])[0] for x in "BCD").rjust(12) for k in STAT_KEYS))
    print(f"\nwritten: {path}  ({report['seconds']:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
