"""Make the GGUF plan reference (key ``plans`` of tests/fixtures/gguf_llamacpp.json) with llama.cpp's own tools from
llama.cpp's own input, or check that the stored reference still comes out of them (``--check``).

    make gguf-plan-fixture                 # the llama.cpp venv, then this script (GGUF_FIXTURE_ARGS=--check: check);
                                           # the script makes the converter's venv itself
    .cache/venv-crosscheck-llamacpp/bin/python tools/gguf_plan_fixture.py \\
        --convert-python .cache/venv-llamacpp-convert/bin/python [--check]

Nothing of quantdyn's GGUF writer goes into the reference. For each RandomState model of tests/formats_models.py
(GPT-NeoX and LLaMA, 2 blocks, and their 16-block versions):

1. the HF checkpoint (``build_checkpoint``: config.json and float32 model.safetensors, as transformers saves it);
2. llama.cpp's converter, ``convert_hf_to_gguf.py --outtype f32``, from the ``vendor/llama.cpp`` of the
   llama-cpp-python 0.3.36 sdist (the llama.cpp the installed wheel was built from), with that tree's own gguf-py
   (0.19.0), run in a venv of its own with llama.cpp's requirements for it
   (requirements/requirements-convert_legacy_llama.txt: transformers 4.57.6, numpy 2.2.6, sentencepiece, protobuf;
   torch is the project's 2.13.0 CPU build, not the 2.11.0 the file pins from download.pytorch.org: the converter
   only reshapes, permutes and concatenates float32 tensors). One thing is changed, because the fixture checkpoints
   have no tokenizer: the two model classes write no vocabulary (the converter's own ``_set_vocab_none``,
   tokenizer model "none", which llama-quantize never reads). Tensor names, order, q/k permutation (LLaMA) and
   the [Q; K; V] reordering (GPT-NeoX) are the converter's;
3. ``llama-quantize``, compiled from the same sources against the installed wheel's libraries
   (``bench/crosscheck_llamacpp.build_llama_tool``), run on that F32 file with the arguments quantdyn's
   ``llama_quantize_args`` gives for the plan ``tests/test_plan_exports.gguf_plan`` (``plans``), with Q4_K_M on the
   2-block models (``models.*.llama_quantize_q4_k_m``) and with Q3_K_M, Q4_K_M and Q5_K_M on the 16-block models
   (``models.*.recipes_16_blocks``).

Recorded per model under ``plans``: the arguments, the type and sha256 of every tensor llama-quantize wrote, the
converter's hyperparameters (every ``<arch>.`` key of its F32 file) and llama.cpp's next-token log-probabilities of
quantdyn's own plan GGUF (llama-cpp-python, the same library). ``--check`` compares all of that (and the Q4_K_M and
recipe entries) with the stored fixture and exits 1 on any difference; without it the fixture is rewritten
(provenance: tests/README.md, "GGUF reference fixtures").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "gguf_llamacpp.json"
CONVERTED = ("GPTNeoXForCausalLM", "LlamaForCausalLM")
RECIPES = ("Q3_K_M", "Q4_K_M", "Q5_K_M")
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
"""The llama.cpp commit vendored by the llama-cpp-python release bench/crosscheck_llamacpp.py pins (its sdist has no
git metadata, and llama-quantize prints no version)."""


def convert(llama_cpp: Path, checkpoint: Path, out: Path) -> None:
    """Run in the converter's venv (``--convert``): llama.cpp's convert_hf_to_gguf.py as its own ``__main__``, the
    model classes of the fixture checkpoints writing no vocabulary (module docstring)."""
    sys.path.insert(0, str(llama_cpp))
    from conversion import get_model_class

    for arch in CONVERTED:
        cls = get_model_class(arch)
        cls.set_vocab = cls._set_vocab_none
    script = llama_cpp / "convert_hf_to_gguf.py"
    sys.argv = [str(script), str(checkpoint), "--outtype", "f32", "--outfile", str(out)]
    runpy.run_path(str(script), run_name="__main__")


def tensors_of(path: Path) -> dict[str, list[str]]:
    import gguf
    import numpy as np

    return {t.name: [t.tensor_type.name, hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()]
            for t in gguf.GGUFReader(str(path)).tensors}


def arch_keys(path: Path) -> dict:
    """Every ``<arch>.`` key of a GGUF file (the model's hyperparameters), floats as stored (float32)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    return {f.name: f.contents() for f in r.fields.values() if f.name.startswith(f"{arch}.")}


def make(args) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT / "tests" / "fixtures")]
    from crosscheck_llamacpp import LLAMA_CPP_PYTHON, build_llama_tool, llama_cpp_source
    from formats_models import LLAMA, NEOX, build_checkpoint
    from make_gguf_reference import llama_logprobs
    from test_plan_exports import export_gguf_plan, gguf_plan

    from quantdyn.export.llama_quantize import llama_quantize_args

    work = Path(args.work)
    src = llama_cpp_source(work, Path(args.llama_src) if args.llama_src else None)
    llama_cpp = src / "vendor" / "llama.cpp"
    binary, _ = build_llama_tool(work, "quantize", src)
    convert_python = Path(args.convert_python)
    if not convert_python.exists():  # the converter's venv: llama.cpp's requirements for it, the project's torch
        venv = convert_python.parent.parent
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(convert_python), "-m", "pip", "install", "-q", args.torch_spec, "-r",
                        str(llama_cpp / "requirements" / "requirements-convert_legacy_llama.txt")], check=True)
    out: dict = {"plans": {"llama_cpp": f"{LLAMA_CPP_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON})",
                           "tool": "convert_hf_to_gguf.py --outtype f32, then llama-quantize --tensor-type "
                                   "(tools/gguf_plan_fixture.py)"},
                 "models": {}}

    def f32_of(spec, tmp: Path) -> Path:
        ck = build_checkpoint(spec, tmp / spec.name)
        f32 = tmp / f"{spec.name}-f32.gguf"
        subprocess.run([str(convert_python), __file__, "--convert", str(llama_cpp), str(ck), str(f32)], check=True,
                       capture_output=not args.verbose)
        return f32

    def quantize(f32: Path, dst: Path, qargs: list[str]) -> dict:
        r = subprocess.run([str(binary), *qargs[:-3], str(f32), str(dst), qargs[-1]], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"llama-quantize failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        return tensors_of(dst)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for spec in (NEOX, LLAMA):
            t0 = time.perf_counter()
            f32 = f32_of(spec, tmp)
            plan = gguf_plan(spec)
            qargs = llama_quantize_args(plan)
            (tmp / "ours").mkdir(exist_ok=True)
            ours = export_gguf_plan(spec, tmp / "ours")
            out["plans"][spec.name] = {
                "args": qargs, "llama_quantize": quantize(f32, tmp / f"{spec.name}-plan.gguf", qargs),
                "converter_hparams": arch_keys(f32), "logprobs": llama_logprobs(ours)}
            q4 = quantize(f32, tmp / f"{spec.name}-q4_k_m.gguf", ["x", "y", "Q4_K_M"])
            deep = f32_of(spec.deep(), tmp)
            recipes = {mix.lower(): {k: v[0] for k, v in quantize(deep, tmp / f"deep-{mix}.gguf", ["x", "y", mix]).items()}
                       for mix in RECIPES}
            out["models"][spec.name] = {"llama_quantize_q4_k_m": {k: v for k, v in q4.items() if k.startswith("blk.")},
                                        "recipes_16_blocks": recipes}
            print(f"{spec.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def differences(new: dict, ref: dict) -> list[str]:
    bad = []
    for name, entry in new["plans"].items():
        if not isinstance(entry, dict):
            continue
        old = ref.get("plans", {}).get(name, {})
        for key, value in entry.items():
            if key == "logprobs":
                if old.get(key) is None or max(abs(a - b) for x, y in zip(value, old[key]) for a, b in zip(x, y)) > 1e-4:
                    bad.append(f"plans.{name}.logprobs")
            elif old.get(key) != value:
                bad.append(f"plans.{name}.{key}")
    for name, entry in new["models"].items():
        for key, value in entry.items():
            if ref["models"][name].get(key) != value:
                bad.append(f"models.{name}.{key}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--convert", nargs=3, metavar=("LLAMA_CPP", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--convert-python", default=str(ROOT / ".cache" / "venv-llamacpp-convert" / "bin" / "python"),
                    help="the Python of the converter's venv (made there if absent)")
    ap.add_argument("--torch-spec", default="torch==2.13.0", help="the torch the converter's venv gets")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "crosscheck-llamacpp"))
    ap.add_argument("--llama-src", default="", help="an unpacked llama-cpp-python sdist (default: pip download)")
    ap.add_argument("--check", action="store_true", help="compare with the stored fixture instead of writing it")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.convert:
        convert(*map(Path, args.convert))
        return 0
    new = make(args)
    ref = json.loads(FIXTURE.read_text())
    bad = differences(new, ref)
    if args.check:
        print("the stored GGUF reference comes out of llama.cpp's converter and llama-quantize" if not bad
              else "differs from the stored fixture: " + ", ".join(bad))
        return 1 if bad else 0
    ref["plans"] = new["plans"]
    for name, entry in new["models"].items():
        ref["models"][name].update(entry)
    ref["f32_input"] = ("convert_hf_to_gguf.py --outtype f32 for llama_quantize_q4_k_m, recipes_16_blocks and plans "
                        "(tools/gguf_plan_fixture.py); f32_logprobs were computed on make_gguf_reference.py's F32 file")
    FIXTURE.write_text(json.dumps(ref, indent=1))
    print("wrote", FIXTURE, "; changed:", ", ".join(bad) or "nothing but provenance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
