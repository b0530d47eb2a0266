"""The report of the same rows stays the same page: index.html, findings.json/.html, every CSV and every figure
of the reports that together draw each section and each finding family, compared with the manifest: "every
section" and "no finding" written at main d0e72d3 (before findings and report sections became registered objects),
"rotations and sensitivity" (the finding family and the report section that came after it) added for issue 47.

What is compared: the page's text and every table with the temporary directory, the date and the provenance
block (machine, versions, time of writing) taken out and every number rounded to 9 significant digits (the
last bits of a sum may differ between CPUs); the names of every file written; and, where this machine has the
matplotlib version and architecture the manifest was written with, the bytes of every PNG and SVG.

A change that is meant to change the report rewrites the manifest: ``python tests/test_report_equivalence.py``
(and says why in its commit)."""
from __future__ import annotations

import hashlib
import json
import math
import platform
import re
import sys
from pathlib import Path

import pytest

MANIFEST = Path(__file__).parent / "fixtures" / "report_equivalence.json"
_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?|-?\d+e[-+]?\d+")
_FIGURE = (".png", ".svg")


def equivalence_rows(root: Path) -> list[dict]:
    """Rows that make the report draw every section and compute every finding family but the rotations family and
    the sensitivity section (:func:`rotation_and_sensitivity_rows`): the noisy study (decay,
    averaging, sharpness, predictors; seeds, cooldowns, a LAWA average), a second optimizer, accuracy, scaling
    fits and public trajectories (tests/test_report_layout.py every_figure_rows), the same study at a second
    peak LR (peak_lr), and per-block errors and KL by confidence on one run (the error maps)."""
    from test_report_layout import every_figure_rows

    rows = every_figure_rows(root)
    lr2 = [{**r, "run": r["run"].replace("demo-", "demo-lr1e-3-"), "peak_lr": 1e-3, "key": "lr2-" + r["key"],
            "checkpoint": r["checkpoint"].replace("/demo-", "/demo-lr1e-3-"),
            **({"delta_ce": r["delta_ce"] * 0.9, "ce_q": r["ce_fp"] + r["delta_ce"] * 0.9,
                "window_delta": [w * 0.9 for w in r["window_delta"]]} if r["kind"] == "ptq" else {})}
           for r in rows if r.get("run", "").startswith("demo-s") and r.get("branch") == "main"]
    for k, r in enumerate(x for x in rows if x["kind"] == "ptq" and x.get("run") == "demo-s0"):
        r["block_rel_fro"] = [0.01 * (1 + b) * (1 + k % 7) for b in range(4)]
        r["kl_by_confidence"] = [0.2 / (1 + b) * (1 + k % 5) for b in range(5)]
        r["confidence_fraction"] = [0.1, 0.15, 0.2, 0.25, 0.3]
    return rows + lr2


ROTATED = ("gptq3", "gptq3+had")
"""The pair of the rotations family: gptq3, whose decay effect the noisy study resolves, and its rotated twin."""
SENSITIVITY_TYPES = (("q3_k", 1e-2, 3.4375), ("q4_k", 2.5e-3, 4.5))
"""(candidate type, predicted KL of one tensor group at the first checkpoint, bits per weight)."""


def rotation_and_sensitivity_rows(root: Path) -> list[dict]:
    """Rows that make the report compute the rotations finding family and draw the sensitivity section: the noisy
    study (run ``rot``, two seeds, cooldowns and controls) with gptq3 and gptq3+had, whose per-window Δ CE is
    gptq3's scaled by 0.8 plus a fixed offset per window (the rotation lowers the error and shrinks its decay
    effect), every checkpoint hashed so the per-checkpoint gains pair; and per-group and whole-model sensitivity
    rows at every checkpoint of seed 0 for two candidate types, the decayed branches 1.5x more sensitive in block
    3's MLP. Deterministic: no draws beyond the noisy study's seeded ones."""
    from test_report_layout import noisy_study_rows

    plain, rotated = ROTATED
    rows = [r for r in noisy_study_rows(run="rot", root=str(root / "runs"))
            if r["kind"] == "fp" or r.get("quantizer") == plain]
    for r in rows:
        r["checkpoint_hash"] = f"ck-{r['run']}-{r['branch']}-{r['step']}"
    twins = []
    for r in rows:
        if r["kind"] != "ptq":
            continue
        wd = [0.8 * w + 0.0004 * (k % 4 - 1.5) for k, w in enumerate(r["window_delta"])]
        d = sum(wd) / len(wd)
        se = (sum((w - d) ** 2 for w in wd) / (len(wd) - 1) / len(wd)) ** 0.5
        twins.append({**r, "key": r["key"] + "+had", "quantizer": rotated, "quantizer_spec": rotated,
                      "rotation": "had", "rotation_seed": 0, "quant_config_hash": f"cfg-{rotated}",
                      "window_delta": wd, "delta_ce": d, "delta_ce_se": se, "delta_ce_total_se": se,
                      "ce_q": r["ce_fp"] + d, "rel_delta_ce": d / r["ce_fp"],
                      "delta_ppl": math.exp(r["ce_fp"] + d) - math.exp(r["ce_fp"]), "kl": abs(0.8 * d) + 1e-4,
                      "kl_se": 0.8 * se, "top1_agree": 1 / (1 + abs(d))})
    groups = [f"{b}.{g}" for b in range(4) for g in ("attn", "mlp")]
    points = sorted({(r["branch"], r["ckpt_kind"], r["step"], r["tokens"], r["lr"], r["checkpoint_hash"])
                     for r in rows if r["kind"] == "fp" and r["run"] == "rot-s0" and r["ckpt_kind"] != "lawa"})
    sens = []
    for branch, kind, step, tokens, lr, h in points:
        base = {"kind": "sensitivity", "run": "rot-s0", "branch": branch, "ckpt_kind": kind, "step": step,
                "tokens": tokens, "lr": lr, "checkpoint_hash": h, "sens_types": [t for t, _, _ in SENSITIVITY_TYPES]}
        for t, kl, bpw in SENSITIVITY_TYPES:
            scale = kl * (1 + 0.2 * step / 200) * (1 + 0.01 * (step // 25 % 3))
            for i, g in enumerate(groups):
                v = scale * (1 + i) * (1.5 if g == "3.mlp" and kind == "cooldown" else 1.0)
                sens.append({**base, "key": f"sens-{branch}-{step}-{t}-{g}", "scope": "group", "tensor": g,
                             "block": int(g[0]), "tensor_group": g[2:], "type": t, "kl_pred": v,
                             "kl_pred_se": 0.02 * v, "bits_per_weight": bpw})
            sens.append({**base, "key": f"sens-{branch}-{step}-{t}-all", "scope": "model", "tensor": "all",
                         "block": None, "tensor_group": "all", "type": t, "kl_pred": scale * 36,
                         "kl_pred_se": 0.02 * scale * 36, "bits_per_weight": bpw})
    return rows + twins + sens


def _normalized(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "<TMP>")
    text = re.sub(r"<section id='provenance'>.*?</section>", "", text, flags=re.S)
    text = re.sub(r"written \d{4}-\d\d-\d\d[^·<]*", "written <DATE>", text)
    return _NUMBER.sub(lambda m: f"{float(m.group()):.9g}", text)


def _describe(out: Path, tmp: Path) -> dict[str, str]:
    files: dict[str, str] = {}
    for p in sorted(out.iterdir()):
        if p.name in ("provenance.json", "rows.json"):
            continue
        data = p.read_bytes()
        if p.suffix not in _FIGURE:
            data = _normalized(data.decode(), tmp).encode()
        files[p.name] = hashlib.sha256(data).hexdigest()
    return files


def report_manifest(tmp: Path) -> dict:
    """Write three reports under ``tmp`` with their findings, and describe them: the rows of
    :func:`equivalence_rows` (every section and finding family but the two below), the public trajectories alone
    (no finding: the page says so first), and :func:`rotation_and_sensitivity_rows` (the rotations family and the
    sensitivity section)."""
    import matplotlib

    from quantdyn.api import write_report
    from quantdyn.results.store import ResultStore

    rows = equivalence_rows(tmp)
    stores = {"every section": rows, "no finding": [r for r in rows if r.get("ckpt_kind") == "hub"],
              "rotations and sensitivity": rotation_and_sensitivity_rows(tmp / "rot")}
    reports = {}
    for name, these in stores.items():
        slug = name.replace(" ", "_")
        ResultStore(tmp / slug).append(these)
        with matplotlib.rc_context({"svg.hashsalt": "report-equivalence"}):  # SVG ids from a fixed salt
            write_report(tmp / slug, tmp / f"{slug}_report")
        reports[name] = _describe(tmp / f"{slug}_report", tmp)
    return {"matplotlib": matplotlib.__version__, "machine": platform.machine(), "reports": reports}


@pytest.mark.e2e
def test_the_report_of_the_same_rows_is_the_same_page(tmp_path):
    want = json.loads(MANIFEST.read_text())
    got = report_manifest(tmp_path)
    figures = want["matplotlib"] == got["matplotlib"] and want["machine"] == got["machine"]
    assert sorted(got["reports"]) == sorted(want["reports"])
    for name, files in want["reports"].items():
        mine = got["reports"][name]
        assert sorted(mine) == sorted(files), f"{name}: the report writes other files"
        differ = [f for f, digest in files.items() if mine[f] != digest and (figures or not f.endswith(_FIGURE))]
        assert differ == [], f"{name}: these files changed (written under {tmp_path}): {differ}"


if __name__ == "__main__":  # rewrite the manifest from this checkout
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        MANIFEST.write_text(json.dumps(report_manifest(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {MANIFEST}")
