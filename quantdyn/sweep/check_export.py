"""Does an export compute what quantdyn measured? ``quantdyn check-export EXPORT --checkpoint CKPT``.

An export written by ``quantdyn quantize --export`` names its quantizer (``quantdyn_export.json`` beside a GPTQ or
compressed-tensors checkpoint; the GGUF metadata key ``quantdyn.quantizer`` of a ``.gguf`` file). This module loads
the export with the library that serves it -- transformers (+ compressed-tensors, or optimum + GPTQModel for GPTQ),
llama-cpp-python for GGUF -- computes its CE on evaluation windows, and measures that quantizer on the checkpoint
with quantdyn's engine on the same windows, with the same calibration draw ``quantize`` uses (draw 0 of the same
data options), so a GPTQ export is compared with the same GPTQ solution.

The verdict compares the per-window difference d = CE(loaded) - CE(quantdyn) with what arithmetic alone moves a
window's CE: the export agrees when the RMS of d over the windows is at most the tolerance

* 2 x the RMS of the checkpoint's bf16 noise floor per window, measured in the same pass (engine/noise_floor.py:
  what rounding every block's output to bf16 does to each window's CE). Serving kernels compute in bf16/fp16
  (GPTQModel's CPU kernels too) and round inside the blocks as well, hence the factor 2 -- a margin, not a
  figure measured against those kernels here; plus
* for GGUF, 25 % of the RMS of the quantizer's own per-window Δ CE: llama.cpp quantizes activations to 8 bits
  inside its dot products, and tests/test_formats_export.py bounds its gap to quantdyn's fake quantization of
  the same file by 25 % of the quantization's effect.

The RMS, not the mean: a file that computes another function differs window by window in both directions, and its
mean difference can sit inside its own SE (a damaged export of a random-weight model: mean +0.006 ± 0.004 nats).
An export of the same weights is exact to ~1e-5 nats (compressed-tensors, tests/test_export.py), far inside it; an
export of another checkpoint or quantizer, or a corrupted one, differs by the size of a quantization effect.
"""
from __future__ import annotations

import importlib.util
import io
import json
from contextlib import nullcontext, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.engine.lazy_model import LazyModel, compute_dtype_of
from quantdyn.engine.measure import measure
from quantdyn.engine.rows import calibration_draws
from quantdyn.errors import QuantdynError
from quantdyn.export.writer import PROVENANCE_FILE
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.results.stats import mean_se
from quantdyn.runs import resolve_run_reference
from quantdyn.runtime import resolve_device
from quantdyn.sources.hub import open_checkpoint

GGUF_SHARE = 0.25
"""The share of the quantizer's |Δ CE| llama.cpp's 8-bit activations may add (module docstring)."""

NEEDS = {
    "compressed-tensors": (("transformers", "compressed_tensors"), "pip install compressed-tensors (quantdyn's "
                           "'export' extra)"),
    "gptq": (("transformers", "optimum", "gptqmodel"), "pip install optimum gptqmodel (quantdyn's 'crosscheck' "
             "extra; `make crosscheck-load` builds a venv with them)"),
    "gguf": (("gguf", "llama_cpp"), "pip install llama-cpp-python==0.3.36 gguf (`make crosscheck-llamacpp` builds a "
             "venv with them)"),
}
"""Per export format: the modules that load it, and the one line that says how to get them."""

_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
               "num_attention_heads", "num_key_value_heads", "n_embd", "n_layer", "n_head", "d_model")


@dataclass(frozen=True)
class ExportInfo:
    """What an export says about itself."""

    path: Path
    format: str
    """compressed-tensors, gptq or gguf."""
    quantizer: str
    """The quantdyn label it was made with."""
    config: dict
    """config.json (GPTQ, compressed-tensors) or the GGUF sizes as {num_hidden_layers, hidden_size}."""


@dataclass(frozen=True)
class ExportCheck:
    """CE of the loaded export and of quantdyn's measurement of its quantizer, on the same windows."""

    export: ExportInfo
    ce_loaded: float
    ce_quantdyn: float
    ce_fp: float
    difference: float
    """mean over windows of CE(loaded) - CE(quantdyn)."""
    difference_se: float
    """Its paired SE."""
    difference_rms: float
    """sqrt(mean over windows of d²): what the verdict compares."""
    tolerance: float
    """The agreement bound on ``difference_rms`` (module docstring)."""
    n_windows: int

    @property
    def agrees(self) -> bool:
        return self.difference_rms <= self.tolerance

    def lines(self) -> list[str]:
        q = self.export.quantizer
        return [
            f"export {self.export.path} ({self.export.format}, quantizer {q}), {self.n_windows} windows",
            f"  CE loaded    {self.ce_loaded:.5f}   ({self.export.format} loaded as it is served)",
            f"  CE quantdyn  {self.ce_quantdyn:.5f}   (quantdyn's {q} on the checkpoint; FP {self.ce_fp:.5f})",
            f"  difference   {self.difference:+.6f} ± {self.difference_se:.6f} (paired SE); per window RMS "
            f"{self.difference_rms:.6f}, tolerance {self.tolerance:.6f} (2x the bf16 noise floor's"
            + (f", + {GGUF_SHARE:.0%} of the quantizer's" if self.export.format == "gguf" else "") + ")",
            ("agrees: the export computes the CE quantdyn measured" if self.agrees else
             "DOES NOT AGREE: the export computes another CE than quantdyn's measurement of its quantizer on this "
             "checkpoint (another checkpoint, quantizer or calibration set, or a damaged file)"),
        ]


def read_export_info(export: str | Path) -> ExportInfo:
    """The format and quantizer an export names; one line when ``export`` is not a quantdyn export."""
    path = Path(export)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_info(path)
    if not path.exists():
        raise QuantdynError(f"export '{path}' does not exist; give an export directory or .gguf file written by "
                            "quantdyn quantize --export")
    prov = path / PROVENANCE_FILE
    if not path.is_dir() or not prov.is_file() or not (path / "config.json").is_file():
        raise QuantdynError(f"'{path}' is not a quantdyn export (no {PROVENANCE_FILE} and config.json); give the "
                            "directory or .gguf file that quantdyn quantize --export wrote")
    try:
        meta = json.loads(prov.read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise QuantdynError(f"'{path}': {PROVENANCE_FILE} or config.json is unreadable ({e}); re-create the export")
    fmt, said = meta.get("format"), meta.get("quantizer")
    # the writer stores {"name": label, "quantizer": its config, ...} (quantization_config's quantdyn entry)
    quantizer = said.get("name") if isinstance(said, dict) else said
    if fmt not in ("gptq", "compressed-tensors") or not isinstance(quantizer, str):
        raise QuantdynError(f"'{prov}' names no format and quantizer quantdyn can check (format {fmt!r}); "
                            "re-create the export with quantdyn quantize --export")
    return ExportInfo(path, fmt, quantizer, config)


def _gguf_info(path: Path) -> ExportInfo:
    if importlib.util.find_spec("gguf") is None:
        raise QuantdynError(f"reading a GGUF file needs the gguf package: {NEEDS['gguf'][1]}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 -- gguf raises ValueError, struct errors, ... on a file that is not GGUF
        raise QuantdynError(f"'{path}' is not a readable GGUF file ({type(e).__name__}: {e})")

    def value(key: str):
        f = reader.fields.get(key)
        if f is None:
            return None
        part = f.parts[f.data[0]]
        return bytes(part).decode() if f.types and f.types[0].name == "STRING" else int(part[0])

    quantizer, arch = value("quantdyn.quantizer"), value("general.architecture")
    if quantizer is None:
        raise QuantdynError(f"'{path}' has no quantdyn.quantizer metadata: it was not written by quantdyn quantize "
                            "--export gguf, so there is no quantdyn measurement to compare it with")
    sizes = {"num_hidden_layers": value(f"{arch}.block_count"), "hidden_size": value(f"{arch}.embedding_length")}
    return ExportInfo(path, "gguf", quantizer, sizes)


def check_dependencies(fmt: str) -> None:
    """One line naming what to install when the library that loads ``fmt`` is missing."""
    modules, how = NEEDS[fmt]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise QuantdynError(f"loading a {fmt} export needs {', '.join(missing)}, not installed here: {how}")


def _check_same_model(info: ExportInfo, ckpt_config: dict, n_blocks: int, ref: str) -> None:
    """The export was made from a model of the checkpoint's shape; one line naming what differs."""
    if info.format == "gguf":
        theirs = {"num_hidden_layers": n_blocks}
        hidden = next((ckpt_config[k] for k in ("hidden_size", "n_embd", "d_model") if k in ckpt_config), None)
        if hidden is not None:
            theirs["hidden_size"] = hidden
    else:
        theirs = {k: ckpt_config[k] for k in _SHAPE_KEYS if k in ckpt_config}
    differ = [f"{k} {info.config[k]} vs {v}" for k, v in theirs.items()
              if info.config.get(k) is not None and info.config[k] != v]
    if differ:
        raise QuantdynError(f"export '{info.path}' was not made from checkpoint '{ref}' ({'; '.join(differ)}, export vs "
                            "checkpoint); give the checkpoint the export was made from")


def check_export(
    export: str | Path,
    checkpoint: str,
    *,
    calib_data: str = "builtin:kjv",
    calib_samples: int = 32,
    calib_seq_len: int = 128,
    eval_data: str | None = None,
    eval_tokens: int = 4096,
    eval_seq_len: int = 128,
    tokenizer: str | None = None,
    device: str = "auto",
    progress: bool = True,
    echo: Callable[[str], None] | None = None,
) -> ExportCheck:
    """Load ``export`` as it is served and compare its CE with quantdyn's measurement of its quantizer on
    ``checkpoint`` (module docstring). Data options mean what they mean for ``quantize`` and must be those the
    export was made with for a calibrated quantizer (GPTQ, AWQ). Every user error is one line before any work."""
    info = read_export_info(export)
    check_dependencies(info.format)
    qc = parse_quantizer(info.quantizer)
    if eval_tokens < eval_seq_len:
        raise QuantdynError(f"--eval-tokens {eval_tokens} is less than one window of --eval-seq-len {eval_seq_len}")
    ref = resolve_run_reference(checkpoint)
    weights = open_checkpoint(ref)
    dev = resolve_device(device)
    source = LazyModel(weights, compute_dtype_of("auto"), dev)
    _check_same_model(info, weights.config, len(source.blocks), ref)
    tok = tokenizer or (str(weights.path) if Path(ref).is_dir() else ref)
    calib = prepare_data(DataConfig(source=calib_data, tokenizer=tok), progress=progress)
    evald = calib if not eval_data or eval_data == calib_data else prepare_data(
        DataConfig(source=eval_data, tokenizer=tok), progress=progress)
    windows = evald.eval_windows(eval_seq_len, eval_tokens // eval_seq_len)
    calib_ids = calibration_draws(calib, calib_samples, calib_seq_len, 0, 1)[0]  # quantize's draw 0, exactly
    m = measure(source, {qc.name: qc}, windows, calib_ids, device=dev, noise_floor=True,
                on_block=echo if progress else None)
    ours = m.fp_window_ce + torch.tensor(m.metrics[qc.name]["window_delta"], dtype=torch.float64)
    loaded = (_gguf_window_ce(info.path, windows) if info.format == "gguf"
              else _hf_window_ce(info, windows, dev, progress))
    d = loaded - ours
    diff, se = mean_se(d)
    tol = 2 * _rms((m.noise_floor or {}).get("window_delta") or [0.0])
    if info.format == "gguf":
        tol += GGUF_SHARE * _rms(m.metrics[qc.name]["window_delta"])
    return ExportCheck(info, float(loaded.mean()), float(ours.mean()), m.ce_fp, diff, se, _rms(d), tol, len(windows))


def _rms(values) -> float:
    return float(torch.as_tensor(values, dtype=torch.float64).square().mean().sqrt())


def _hf_window_ce(info: ExportInfo, windows: torch.Tensor, dev: torch.device, progress: bool) -> torch.Tensor:
    """Per-window CE of a GPTQ or compressed-tensors export loaded with plain ``from_pretrained``."""
    import transformers  # optional: check_dependencies named it

    if not progress:
        transformers.utils.logging.disable_progress_bar()
    from quantdyn.evaluate.loss import window_losses

    model = transformers.AutoModelForCausalLM.from_pretrained(str(info.path), device_map=None).eval()
    transform = (info.config.get("quantization_config") or {}).get("transform_config")
    if transform:  # a +had export: transformers loads the codes but does not apply the rotation (docs/rotations.md)
        _apply_transform(model, transform, info.path, progress)
    model.to(dev)
    with torch.no_grad():
        return window_losses(model, windows)


def _apply_transform(model, transform: dict, path: Path, progress: bool) -> None:
    """Apply a compressed-tensors transform_config (the rotation of a ``+had`` export) as vLLM does: the
    transform modules of compressed-tensors, their matrices the checkpoint's ``had_input.weight`` tensors."""
    if importlib.util.find_spec("compressed_tensors.transform") is None:
        raise QuantdynError("this export holds a rotation (transform_config), which needs compressed-tensors 0.11 or "
                            "later with compressed_tensors.transform: pip install -U compressed-tensors")
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from safetensors import safe_open

    with nullcontext() if progress else redirect_stderr(io.StringIO()):  # its progress bar, which has no off switch
        apply_transform_config(model, TransformConfig.model_validate(transform))
    mats: dict[int, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.endswith("had_input.weight"):
                    t = st.get_tensor(k)
                    mats[t.shape[0]] = t
    for name, m in model.named_modules():
        if name.endswith("had_input"):
            if m.weight.shape[0] not in mats:
                raise QuantdynError(f"export '{path}' has no had_input.weight of width {m.weight.shape[0]}; it is "
                                    "incomplete: re-create it")
            m.weight.data.copy_(mats[m.weight.shape[0]])


def _gguf_window_ce(path: Path, windows: torch.Tensor) -> torch.Tensor:
    """Per-window CE of a GGUF file run by llama.cpp (llama-cpp-python), one window at a time."""
    import numpy as np
    import llama_cpp  # optional: check_dependencies named it

    from quantdyn.evaluate.loss import ce_of_log_probs

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=windows.shape[1], logits_all=True, verbose=False,
                          n_batch=windows.shape[1])
    out = []
    for w in windows:
        llm.reset()
        llm.eval(w[:-1].tolist())
        lp = torch.log_softmax(torch.tensor(np.array(llm.scores[:len(w) - 1]), dtype=torch.float64), -1)
        out.append(ce_of_log_probs(lp[None], w[None, 1:]))
    return torch.cat(out)


def agrees_exit_code(check: ExportCheck) -> int:
    """The command's exit status: 0 when the export agrees, 1 when it does not (2 is a user error)."""
    return 0 if check.agrees else 1

