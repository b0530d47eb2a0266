"""The report's sensitivity map and decay table (report/sensitivity_maps.py), and checkpoint tick labels that never
touch at 10-50 checkpoints (the per-block heat maps of report/error_maps.py printed them on top of each other)."""
from __future__ import annotations

import math

import pytest

from quantdyn.report import error_maps
from quantdyn.report.output import checkpoint_ticks, subplots
from quantdyn.report.sensitivity_maps import decay_gains, sections, sensitivity_map
from quantdyn.results.schema import PTQ, SENSITIVITY

GROUPS = [f"{b}.{g}" for b in range(4) for g in ("attn", "mlp")]


def _sens_rows(n_main: int = 12) -> list[dict]:
    rows = []

    def point(branch, kind, step, lr, scale, h):
        for t, base in (("q3_k", 1e-2), ("q4_k", 2.5e-3)):
            for i, g in enumerate(GROUPS):
                v = base * (1 + i) * scale * (1.5 if g == "3.mlp" and branch.startswith("cooldown") else 1)
                rows.append({"kind": SENSITIVITY.name, "scope": "group", "tensor": g, "type": t, "run": "r",
                             "branch": branch, "ckpt_kind": kind, "step": step, "tokens": step * 4096, "lr": lr,
                             "checkpoint_hash": h, "kl_pred": v, "kl_pred_se": 0.02 * v,
                             "bits_per_weight": 3.4375 if t == "q3_k" else 4.5})
            rows.append({"kind": SENSITIVITY.name, "scope": "model", "tensor": "all", "type": t, "run": "r",
                         "branch": branch, "ckpt_kind": kind, "step": step, "tokens": step * 4096, "lr": lr,
                         "checkpoint_hash": h, "kl_pred": base, "bits_per_weight": 3.4375 if t == "q3_k" else 4.5})

    for k in range(1, n_main + 1):
        point("main", "checkpoint", 100 * k, 3e-3 if k < 0.8 * n_main else 3e-3 * (n_main - k) / (0.2 * n_main),
              1 + 0.01 * k + 0.003 * math.sin(k), f"m{k}")
    point("cooldown-s1000-d200-linear", "cooldown", 1200, 0.0, 1.2, "c")
    point("control-s1000-d200", "control", 1200, 3e-3, 1.1, "k")
    return rows


def _tick_boxes_disjoint(ax) -> bool:
    fig = ax.figure
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(r) for t in ax.get_xticklabels() if t.get_text()), key=lambda b: b.x0)
    return all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))


@pytest.mark.parametrize("n", [10, 25, 50])
def test_checkpoint_ticks_never_touch(n):
    fig, ax = subplots(figsize=(3.2, 2))
    ax.imshow([[0] * n], aspect="auto")
    labels = [f"{1.2288 * (k + 1):.3g}M" for k in range(n)]
    ticks = checkpoint_ticks(ax, labels)
    assert ticks[0] == 0 and len(ticks) >= 3 and _tick_boxes_disjoint(ax)


def test_the_old_per_block_heat_maps_now_label_50_checkpoints_readably(tmp_path, monkeypatch):
    rows = []
    for k in range(1, 51):
        t = 409600 * k
        rows.append({"kind": PTQ.name, "run": "r", "branch": "main", "quantizer": "gptq3", "bits": 3, "step": 100 * k,
                     "tokens": t, "block_rel_fro": [0.01 * (b + 1) * (1 + k / 50) for b in range(6)]})
    seen = []
    real = error_maps.save_figure

    def spy(fig, out, **kw):
        seen.extend(ax for ax in fig.axes if ax.get_xticklabels() and ax.get_images())
        for ax in seen:
            assert _tick_boxes_disjoint(ax)
        return real(fig, out, **kw)

    monkeypatch.setattr(error_maps, "save_figure", spy)
    table = error_maps.block_heatmaps(rows, "r", tmp_path / "b.png")
    assert len(table) == 50 and seen
    labels = [t.get_text() for t in seen[0].get_xticklabels() if t.get_text()]
    assert 4 <= len(labels) < 50 and all(len(s) <= 6 for s in labels)  # "1.23M", not "1.2288M" on top of each other


def test_sensitivity_map_and_decay_gains(tmp_path):
    rows = _sens_rows()
    table = sensitivity_map(rows, "r", tmp_path / "s.png")
    assert (tmp_path / "s.png").exists() and len(table) == 2 * len(GROUPS) * 12  # main run only
    gains = decay_gains(rows, "r")
    assert len(gains) == 2 * len(GROUPS)
    top = [g for g in gains if g["type"] == "q3_k"][0]
    assert top["group"] == "3.mlp" and top["verdict"] == "decay raises the error" and top["z"] > 2
    assert top["stable_jitter"] is not None  # the stable phase's scatter is part of the uncertainty
    found = sections(rows, tmp_path)
    assert [f[1] for f in found] == ["sensitivity_r.png", "sensitivity_decay_r.png"]


def test_the_map_is_a_registered_report_section_asked_only_with_sensitivity_rows(tmp_path):
    import quantdyn.report.contents  # noqa: F401  (registers the report's sections)
    from quantdyn.report.palette import Palette
    from quantdyn.report.sections import REPORT_SECTIONS, Page, page_sections

    section = REPORT_SECTIONS.get("sensitivity")
    assert section.kind is SENSITIVITY
    rows = _sens_rows()
    page = Page(rows, tmp_path, Palette.for_rows(rows))
    assert [s.figure for s in page_sections(page)] == ["sensitivity_r.png", "sensitivity_decay_r.png"]
    assert not section.applies(Page([r for r in rows if not SENSITIVITY.matches(r)], tmp_path, page.palette))
