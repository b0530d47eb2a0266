"""Offline LAWA, model soups and interpolation (quantdyn/train/offline_averaging.py),
and the online EMA against its closed form."""
import pytest
import torch
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import mean_loss
from quantdyn.models.gpt import GPT, ModelConfig
from quantdyn.models.hf_io import load_gpt
from quantdyn.runs import checkpoint_dir, read_meta
from quantdyn.sources.trajectory import points_of_run
from quantdyn.sweep.interpolation import interpolate_checkpoints
from quantdyn.train.averaging import OnlineEMA
from quantdyn.train.checkpoint import save_checkpoint
from quantdyn.train.config import RunConfig
from quantdyn.train.offline_averaging import average_lawa, make_soup
from quantdyn.train.trainer import train


def ema_closed_form(values, decay: float) -> torch.Tensor:
    """Bias-corrected EMA of a sequence: Σ d^{t-i}(1-d) w_i / (1 - d^t)."""
    vals = [v.double() for v in values]
    t = len(vals)
    num = sum(decay ** (t - 1 - i) * (1 - decay) * v for i, v in enumerate(vals))
    return num / (1 - decay**t)


def _tiny_gpt(seed: int, d_model: int = 32) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=64, n_layer=1, d_model=d_model, n_head=2, max_seq_len=32))


def _sd(path):
    return load_gpt(path).state_dict()


def _assert_state_close(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k, **tol)


@pytest.fixture(scope="module")
def lawa_run(tmp_path_factory, kjv_small):
    """A tiny run with online LAWA (K=3, P=4) and checkpoints every 4 steps up to 12."""
    data_cfg, data = kjv_small
    d = tiny_run_dict(tmp_path_factory.mktemp("avg"), data_cfg)
    d["name"] = "lawa"
    d["averaging"] = {"lawa_window": 3, "lawa_every": 4}
    return train(from_dict(RunConfig, d), progress=False), data


def test_lawa_of_identical_checkpoints_is_the_checkpoint(tmp_path):
    model = _tiny_gpt(0)
    for s in (4, 8, 12):
        save_checkpoint(checkpoint_dir(tmp_path, s), model, {"step": s, "tokens": 10 * s, "lr": 1e-3 / s})
    out = average_lawa(tmp_path, window=3, every=4)
    assert [p.name for p in out] == ["step-0000004", "step-0000008", "step-0000012"]
    assert out[0].parent == tmp_path / "averages" / "lawa-k3-p4-offline"
    for p in out:
        _assert_state_close(_sd(p), model.state_dict(), rtol=0, atol=1e-7)
    m = read_meta(out[-1])
    assert m["kind"] == "lawa" and m["step"] == 12 and m["tokens"] == 120 and m["lr"] == pytest.approx(1e-3 / 12)
    assert [i["step"] for i in m["ingredients"]] == [4, 8, 12]
    assert [i["weight"] for i in m["ingredients"]] == pytest.approx([1 / 3] * 3)
    # a missing ingredient is named, with the fix
    import shutil

    shutil.rmtree(checkpoint_dir(tmp_path, 8))
    with pytest.raises(QuantdynError, match=r"steps 8 .*checkpoint_every must divide P=4"):
        average_lawa(tmp_path, window=3, every=4, out=tmp_path / "x")
    with pytest.raises(QuantdynError, match="no checkpoint .* on the LAWA grid"):
        average_lawa(tmp_path, window=2, every=5)


def test_online_lawa_equals_offline(lawa_run, tmp_path):
    run, _ = lawa_run
    out = average_lawa(run, window=3, every=4, out=tmp_path / "offline")
    assert [p.name for p in out] == ["step-0000004", "step-0000008", "step-0000012"]
    for p in out:
        online = run / "averages" / "lawa-k3-p4" / p.name
        _assert_state_close(_sd(p), _sd(online), rtol=1e-6, atol=1e-7)
        mo, mf = read_meta(online), read_meta(p)
        assert (mf["step"], mf["tokens"], mf["lr"]) == (mo["step"], mo["tokens"], mo["lr"])
        assert [i["step"] for i in mf["ingredients"]] == [i["step"] for i in mo["ingredients"]]
    assert [i["step"] for i in read_meta(out[-1])["ingredients"]] == [4, 8, 12]
    # the tokenizer travels with the average
    assert (out[-1] / "tokenizer.json").is_file()


def test_ema_matches_closed_form():
    lin = torch.nn.Linear(3, 2)
    ema = OnlineEMA(0.9)
    seq = []
    g = torch.Generator().manual_seed(0)
    for _ in range(7):
        with torch.no_grad():
            lin.weight.copy_(torch.randn(2, 3, generator=g))
        seq.append(lin.weight.detach().clone())
        ema.update(lin)
    got = ema.average(lin.state_dict())["weight"]
    torch.testing.assert_close(got.double(), ema_closed_form(seq, 0.9), rtol=1e-6, atol=1e-7)
    assert torch.allclose(ema_closed_form(seq[:1], 0.9), seq[0].double())  # bias correction: ê_1 = w_1


def test_uniform_and_weighted_soup(tmp_path):
    a, b = _tiny_gpt(1), _tiny_gpt(2)
    pa = save_checkpoint(tmp_path / "a", a, {"run": "r", "step": 8, "tokens": 80, "lr": 1e-3, "seed": 1})
    pb = save_checkpoint(tmp_path / "b", b, {"run": "r", "step": 8, "tokens": 80, "lr": 1e-3, "seed": 2})
    soup = make_soup([pa, pb], out=tmp_path / "soup")
    mean = {k: (a.state_dict()[k] + b.state_dict()[k]) / 2 for k in a.state_dict()}
    _assert_state_close(_sd(soup), mean)
    m = read_meta(soup)
    assert m["kind"] == "soup" and m["method"] == "uniform" and m["run"] == "r" and m["seed"] is None
    assert [i["weight"] for i in m["ingredients"]] == [0.5, 0.5] and m["step"] == 8
    w = make_soup([pa, pb], weights=[1, 3], out=tmp_path / "w")
    _assert_state_close(_sd(w), {k: 0.25 * a.state_dict()[k] + 0.75 * b.state_dict()[k] for k in mean})
    pc = save_checkpoint(tmp_path / "c", _tiny_gpt(3, d_model=16), {"step": 8})
    with pytest.raises(QuantdynError, match="hidden_size differs"):
        make_soup([pa, pc], out=tmp_path / "bad")
    with pytest.raises(QuantdynError, match="one weight per checkpoint"):
        make_soup([pa, pb], weights=[1.0], out=tmp_path / "bad")


def test_greedy_soup_never_worse_than_best_ingredient(lawa_run, tmp_path):
    run, data = lawa_run
    windows = data.eval_windows(32, 16)
    noise = load_gpt(checkpoint_dir(run, 12))
    torch.manual_seed(0)
    with torch.no_grad():  # a clearly bad ingredient: the final model plus large noise
        for p in noise.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    bad = save_checkpoint(tmp_path / "noisy", noise, {"run": "lawa", "step": 12, "tokens": 0})
    ckpts = [checkpoint_dir(run, s) for s in (4, 8, 12)] + [bad]
    soup = make_soup(ckpts, greedy=True, eval_windows=windows, out=tmp_path / "greedy")
    losses = [mean_loss(load_gpt(c), windows) for c in ckpts]
    soup_loss = mean_loss(load_gpt(soup), windows)
    assert soup_loss <= min(losses) + 1e-9
    m = read_meta(soup)
    assert m["method"] == "greedy" and m["held_out_loss"] == pytest.approx(soup_loss, abs=1e-6)
    kept = {i["path"] for i in m["ingredients"]}
    assert str(bad.resolve()) not in kept and len(m["considered"]) == 4
    # considered in order of held-out loss; the best one always kept
    assert [c["held_out_loss"] for c in m["considered"]] == sorted(losses)
    assert m["considered"][0]["accepted"]
    # the soup is never worse than the current soup at any accepted step
    accepted = [c["soup_loss_with"] for c in m["considered"] if c["accepted"]]
    assert accepted == sorted(accepted, reverse=True)


def test_interpolation_endpoints_and_rows(lawa_run):
    run, _ = lawa_run
    a, b = checkpoint_dir(run, 4), checkpoint_dir(run, 12)
    rows = interpolate_checkpoints(a, b, steps=3, quantizers=("rtn4",), eval_seq_len=32, eval_windows=8,
                                   calib_samples=4, calib_seq_len=32, device="cpu")
    assert [r["alpha"] for r in rows] == [0.0, 0.5, 1.0] and len({r["key"] for r in rows}) == 3
    out = run / "averages" / "interp-step-0000004-step-0000012"
    paths = [out / f"alpha-{x:.4f}" for x in (0.0, 0.5, 1.0)]
    assert [r["checkpoint"] for r in rows] == [str(p) for p in paths]
    _assert_state_close(_sd(paths[0]), _sd(a), rtol=0, atol=0)
    _assert_state_close(_sd(paths[-1]), _sd(b), rtol=0, atol=0)
    sa, sb = _sd(a), _sd(b)
    _assert_state_close(_sd(paths[1]), {k: (sa[k] + sb[k]) / 2 for k in sa})
    from quantdyn.data.prepare import prepare_data
    from quantdyn.train.offline_averaging import data_config_of

    windows = prepare_data(data_config_of(a), progress=False).eval_windows(32, 8)
    assert rows[0]["ce_fp"] == pytest.approx(mean_loss(load_gpt(a), windows), rel=1e-6)
    assert rows[-1]["ce_fp"] == pytest.approx(mean_loss(load_gpt(b), windows), rel=1e-6)
    from quantdyn.results.schema import undocumented

    for r in rows:
        assert r["quantizer"] == "rtn4" and r["bits"] == 4 and r["delta_ce"] == pytest.approx(r["ce_q"] - r["ce_fp"], abs=1e-9)
        assert undocumented(r) == []  # the row schema covers every field
    m = read_meta(paths[1])
    assert m["kind"] == "interpolation" and m["alpha"] == 0.5
    assert [i["step"] for i in m["ingredients"]] == [4, 12]
    # sweeps of the run pick the interpolated models up
    pts = [p for p in points_of_run(run) if p.kind == "interpolation"]
    assert sorted(p.meta["alpha"] for p in pts) == [0.0, 0.5, 1.0]
    with pytest.raises(QuantdynError, match="at least 2 points"):
        interpolate_checkpoints(a, b, steps=1)
