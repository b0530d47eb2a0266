"""Output a person can read (issue 50 item 5): `results --out` prints one line, not the rows; the table shows the
main columns and a list as its length; the demo/study/report summary says each verdict once; a percentage of a
reference is in plain digits, and absent where the reference is not resolved from 0."""
from __future__ import annotations

import csv

from test_report_answer import decay_rows

from quantdyn.results.store import ResultStore
from quantdyn.studies import findings as fd
from quantdyn.studies import section


def _wide_store(root):
    rows = [{"key": f"k{i}", "kind": "ptq", "run": "r", "branch": "main", "step": i, "tokens": 10 * i,
             "quantizer": "rtn4", "ce_fp": 3.0, "ce_q": 3.1, "delta_ce": 0.1 * i, "delta_ce_se": 0.01,
             "kl": 0.02, "top1_agree": 0.9, "kl_p99": 0.5, "window_delta": [0.1] * 200,
             "block_sqnr": [20.0 + j for j in range(12)], **{f"extra_{j}": j for j in range(40)}} for i in (1, 2, 3)]
    ResultStore(root).append(rows)
    return root


def test_results_with_out_prints_one_line_and_writes_every_column(cli, tmp_path):
    st = _wide_store(tmp_path / "st")
    r = cli("results", "--store", st, "--where", "step >= 2", "--out", tmp_path / "rows.csv")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"wrote 2 rows (55 columns) to {tmp_path / 'rows.csv'} (rows where step >= 2)"]
    with open(tmp_path / "rows.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["step"] for row in table] == ["2", "3"] and "extra_39" in table[0] and "block_sqnr" in table[0]


def test_results_table_shows_the_main_columns_and_lists_by_length(cli, tmp_path):
    st = _wide_store(tmp_path / "st")
    r = cli("results", "--store", st)
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["run", "branch", "kind", "step", "tokens", "quantizer", "ce_fp", "ce_q", "delta_ce",
                                "delta_ce_se", "kl", "top1_agree"]
    assert len(lines) == 5 and lines[-1] == "(3 rows; --columns A,B or --all for more columns)"
    r = cli("results", "--store", st, "--columns", "step,block_sqnr")
    assert r.stdout.splitlines()[1].split() == ["1", "[12", "values]"] and r.stdout.splitlines()[-1] == "(3 rows)"
    wide = cli("results", "--store", st, "--all").stdout.splitlines()
    assert "extra_39" in wide[0] and "0.1, 0.1" not in "".join(wide)  # never 200 floats on a line


def _finding(effect, se, baseline, baseline_se):
    return {"finding": "A(a) LR decay raises the quantization error", "family": "decay", "quantizer": "rtn4",
            "comparison": "demo: decayed endpoint − constant-LR control, cooldown-s400-d100-linear (step 500)",
            "metric": "Δ CE", "effect": effect, "se": se, "z_threshold": 2.0, "verdict": fd.NOT_RESOLVED,
            "baseline": baseline, "baseline_se": baseline_se, "baseline_of": "the control's Δ CE"}


def test_a_percentage_is_in_plain_digits_or_absent_where_its_reference_is_unresolved():
    # resolved control (0.001 > 2 x 0.0001): 120 ± 150 %, written out (format_estimate alone gives 1.2e+02 ± 1.5e+02)
    assert section.relative_text(_finding(0.0012, 0.0015, 0.001, 0.0001)) == "+120 ± 150 % of the control's Δ CE"
    assert section.relative_text(_finding(0.00076, 0.0006, 0.0011, 0.0004)) == "+69 ± 55 % of the control's Δ CE"
    assert section.relative_text(_finding(0.0002, 0.0001, 0.01, 0.001)) == "+2.0 ± 1.0 % of the control's Δ CE"
    # a control's Δ CE not resolved from 0 (the demo's 0.0000 ± 0.0003): no ratio, in words, table and figure
    unresolved = _finding(0.00212, 0.00087, 0.00003, 0.0003)
    assert section.relative_text(unresolved) == "" and fd.relative_baseline(unresolved) is None
    statement, _, _ = section.verdict_sentence(unresolved)
    assert "%" not in statement and "+0.00212 ± 0.00087 nats" in statement
    assert section.table_rows([unresolved])[0]["relative"] is None
    at_the_edge = _finding(0.001, 0.0005, 0.002, 0.001)  # baseline exactly 2 SE: not beyond the threshold
    assert section.relative_text(at_the_edge) == ""
    assert section.relative_text(_finding(0.001, 0.0005, -0.01, None)) == ""  # no positive reference
    # rows written before baseline_se existed keep their percentage
    assert section.relative_text(_finding(0.0002, 0.0001, 0.01, None)) == "+2.0 ± 1.0 % of the control's Δ CE"


def test_the_summary_says_each_verdict_once(tmp_path):
    a = section.answer(decay_rows(tmp_path / "runs"))
    lines = section.summary_lines(a)
    text = "\n".join(lines)
    assert len(a.found) == 10
    for f in a.found:
        statement, verdict, _ = section.verdict_sentence(f)
        assert text.count(f"{statement}: {verdict}") == 1
        assert text.count(fd.format_effect(f)) == 0  # the findings table's form of the same number: not printed
    assert text.count(" — reproduced") + text.count(" — opposite") + text.count(" — not resolved") == 10
    assert lines[-1] == section.TABLES_LINE and len(lines) == 1 + 1 + 10 + 1
    # the control's Δ CE of these rows is resolved: every decay sentence keeps its percentage, with its SE
    assert all("% of the control's Δ CE" in section.verdict_sentence(f)[0] for f in a.found)
    assert all(f["baseline_se"] is not None and f["baseline"] > 2 * f["baseline_se"] for f in a.found)
