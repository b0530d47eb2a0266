"""The provenance block at the top of a report: what wrote the report, and what wrote the rows in it.

:func:`collect` gathers the quantdyn version (package metadata), the git commit of the code writing the
report, the machine and date, and, over the rows, every distinct quantizer config hash, evaluation-set
hash, calibration-set hash, data manifest key (``data_key``), commit and machine that wrote them, with
row counts; :func:`to_html` renders it.
"""
from __future__ import annotations

import html
import platform
import sys
import time
from collections import Counter
from pathlib import Path

from quantdyn.runtime import git_sha, hardware

ROW_FIELDS: tuple[tuple[str, str], ...] = (
    ("quant_config_hash", "quantizer config hashes"),
    ("eval_hash", "evaluation set hashes"),
    ("calib_hash", "calibration set hashes"),
    ("data_key", "data manifest keys (token cache)"),
    ("git_sha", "quantdyn commits that wrote the rows"),
    ("hardware", "machines that wrote the rows"),
    ("compute_dtype", "compute dtypes"),
    ("quant_repeats", "quantization repeats R"),
    ("repeat_vary", "what the repeats vary"),
    ("calib_batch_size", "calibration batch sizes"),
    ("quantize_threads", "quantization threads"),
)
"""(row field, what the block calls it): the fields whose distinct values the block lists."""
MIXED_WARNING = ("eval_hash", "calib_hash", "data_key")
"""Fields whose having more than one value among the rows the block warns about."""


def package_version() -> str:
    """quantdyn's version from the installed package metadata (the source's ``__version__`` if not installed)."""
    from importlib import metadata

    try:
        return metadata.version("quantdyn")
    except metadata.PackageNotFoundError:
        import quantdyn

        return f"{quantdyn.__version__} (not installed)"


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _distinct(rows: list[dict], field: str) -> list[dict]:
    """Distinct values of ``field`` (rows that have it), most frequent first, with row counts; for config
    hashes also the quantizer labels that carry them."""
    counts: Counter = Counter()
    labels: dict[str, set] = {}
    for r in rows:
        v = r.get(field)
        if v is None or v == "":
            continue
        key = str(v)
        counts[key] += 1
        if field == "quant_config_hash" and r.get("quantizer"):
            labels.setdefault(key, set()).add(str(r["quantizer"]))
    out = []
    for v, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        item = {"value": v, "rows": n}
        if v in labels:
            item["quantizers"] = sorted(labels[v])
        out.append(item)
    return out


def collect(rows: list[dict], store: str | Path | None = None, run_dir: str | Path | None = None) -> dict:
    """Provenance of a report over ``rows``: the writer (version, commit, machine, date) and the distinct
    values of :data:`ROW_FIELDS` among the rows."""

    kinds = Counter(str(r.get("kind")) for r in rows)
    times = sorted(str(r["time"]) for r in rows if r.get("time"))
    return {
        "quantdyn_version": package_version(),
        "git_commit": git_sha(),
        "machine": hardware(),
        "platform": platform.platform(),
        "versions": _versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv) if sys.argv and sys.argv[0] else None,
        "store": str(store) if store is not None else None,
        "run_dir": str(run_dir) if run_dir is not None else None,
        "rows": len(rows),
        "rows_by_kind": dict(sorted(kinds.items())),
        "rows_written": [times[0], times[-1]] if times else None,
        "fields": {f: _distinct(rows, f) for f, _ in ROW_FIELDS},
    }


def _values_html(items: list[dict], limit: int = 12) -> str:
    if not items:
        return "<em>not recorded</em>"
    parts = []
    for it in items[:limit]:
        q = f" ({html.escape(', '.join(it['quantizers']))})" if it.get("quantizers") else ""
        parts.append(f"<code>{html.escape(it['value'])}</code>{q} <span class='n'>×{it['rows']}</span>")
    more = f" … and {len(items) - limit} more (provenance.json)" if len(items) > limit else ""
    return "; ".join(parts) + more


def to_html(p: dict) -> str:
    """The provenance block (a definition table) for the top of the report."""
    v = p["versions"]
    writer = [
        ("quantdyn", f"{html.escape(p['quantdyn_version'])} · commit <code>{html.escape(p['git_commit'])}</code>"),
        ("written", f"{html.escape(p['date'])} on {html.escape(p['machine'])} ({html.escape(p['platform'])}; "
                    + ", ".join(f"{html.escape(k)} {html.escape(x)}" for k, x in v.items()) + ")"),
    ]
    if p.get("store"):
        writer.append(("results store", f"<code>{html.escape(p['store'])}</code>"))
    if p.get("run_dir"):
        writer.append(("run directory", f"<code>{html.escape(p['run_dir'])}</code>"))
    kinds = ", ".join(f"{html.escape(k)} {n}" for k, n in p["rows_by_kind"].items())
    span = p.get("rows_written")
    writer.append(("rows", f"{p['rows']} ({kinds})" + (f", written {html.escape(span[0])} … {html.escape(span[1])}"
                                                        if span else "")))
    body = [(label, _values_html(p["fields"][f])) for f, label in ROW_FIELDS if p["fields"].get(f)]
    mixed = [label for f, label in ROW_FIELDS if f in MIXED_WARNING and len(p["fields"].get(f) or []) > 1]
    if mixed:
        body.insert(0, ("⚠ mixed sets", "these rows come from more than one of: " + html.escape(", ".join(mixed))
                        + ". Δ CE depends on the evaluation and calibration sets: compare points measured on the "
                          "same ones (the figures' CSVs carry eval_hash and calib_hash)."))
    trs = "".join(f"<tr><th>{html.escape(k)}</th><td>{val}</td></tr>" for k, val in writer + body)
    return (f"<section id='provenance'><h2>Provenance</h2><table class='prov'>{trs}</table>"
            "<p class='small'>All of it, with every value: <a href='provenance.json'>provenance.json</a>; "
            "every row: <a href='rows.json'>rows.json</a>.</p></section>")
