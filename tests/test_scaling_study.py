import pytest

from quantdyn.analysis.scaling import ScalingFit, predict
from quantdyn.errors import QuantdynError
from quantdyn.results.store import ResultStore
from quantdyn.studies.scaling import fit_scaling


def _rows(opt, rho, law, qat=False):
    rows = []
    for i, N in enumerate([2e6, 5e6, 1.2e7, 3e7, 8e7]):
        for j, D in enumerate([2e8, 6e8]):
            run = f"{opt}-{'qat' if qat else 'fp'}-{i}-{j}"
            loss = predict(ScalingFit(*law, rho=rho), N, D)
            rows.append({"key": run, "checkpoint": f"/nonexistent/{run}", "kind": "qat" if qat else "fp", "run": run, "branch": "main", "step": 100,
                         "tokens": D, "n_params": N, "optimizer": opt, "qat": "quest-w4a4" if qat else None,
                         "ce_fp": loss + (0.3 if qat else 0.0), "ce_q": loss, "time": "t"})
    return rows


def test_scaling_fits_recover_rho_per_optimizer(tmp_path):
    law = (400.0, 0.34, 410.0, 0.28, 1.7)
    st = ResultStore(tmp_path / "st")
    st.append(_rows("adamw", 1.0, law) + _rows("adamw", 0.6, law, qat=True)
              + _rows("shampoo", 1.0, law) + _rows("shampoo", 0.8, law, qat=True))
    fits = {(r["group"], r["precision"]): r for r in fit_scaling(str(tmp_path / "st"), all_checkpoints=False,
                                                                   bootstrap=0)}
    assert fits[("adamw", "qat")]["rho"] == pytest.approx(0.6, rel=0.02)
    assert fits[("shampoo", "qat")]["rho"] == pytest.approx(0.8, rel=0.02)
    fp = fits[("adamw", "fp")]  # the full-precision law is fitted on the FP points alone and recovers the N term
    assert fp["n_points"] == 10 and {p["precision"] for p in fp["points"]} == {"fp"}
    assert fp["A"] == pytest.approx(400.0, rel=1e-3) and fp["alpha"] == pytest.approx(0.34, rel=1e-3)
    assert len([r for r in st.rows() if r["kind"] == "scaling"]) == 4
    from quantdyn.results.schema import undocumented

    assert all(undocumented(r) == [] for r in st.rows() if r["kind"] == "scaling")  # the row schema covers them
    from quantdyn.report.html import write_page

    page = write_page(tmp_path / "st", tmp_path / "rep")
    assert (tmp_path / "rep" / "scaling.png").is_file() and "Scaling laws" in page.read_text()


def test_scaling_needs_enough_points(tmp_path):
    st = ResultStore(tmp_path / "st")
    st.append(_rows("adamw", 1.0, (400.0, 0.34, 410.0, 0.28, 1.7))[:4])
    with pytest.raises(QuantdynError, match="needs at least 5"):
        fit_scaling(str(tmp_path / "st"))
