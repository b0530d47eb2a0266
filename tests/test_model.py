import pytest
import torch

from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, PRESETS, ModelConfig, resolve_model_config
from quantdyn.models.hf_io import load_causal_lm, load_gpt, save_hf


def _model(**kw):
    torch.manual_seed(0)
    m = GPT(resolve_model_config(ModelConfig(vocab_size=96, n_layer=2, d_model=64, n_head=4, **kw)))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # move LayerNorms/biases off their init
    return m.eval()


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_transformers_gptneox(tmp_path, parallel, tie):
    from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM

    m = _model(parallel_residual=parallel, tie_embeddings=tie)
    save_hf(m, tmp_path / "ck")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    assert isinstance(hf, GPTNeoXForCausalLM)
    x = torch.randint(0, 96, (3, 21))
    with torch.no_grad():
        torch.testing.assert_close(m(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    back = load_gpt(tmp_path / "ck")
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x), rtol=0, atol=0)


def test_pythia_preset_shapes():
    """Parameter counts equal Pythia's published ones (Biderman et al. 2023, Table 1), for every Pythia preset:
    the models are built on the meta device, so even 1B costs no memory."""
    from quantdyn.engine.lazy_model import params_on_meta

    published = {"pythia-14m": 14_067_712, "pythia-70m": 70_426_624, "pythia-160m": 162_322_944,
                 "pythia-410m": 405_334_016, "pythia-1b": 1_011_781_632}
    for name, n_params in published.items():
        with params_on_meta():
            m = GPT(resolve_model_config(ModelConfig(preset=name)))
        assert sum(p.numel() for p in m.parameters()) == n_params, name
    cfg = resolve_model_config(ModelConfig(preset="pythia-160m"))
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.ff_dim, cfg.vocab_size) == (12, 768, 12, 3072, 50304)
    assert set(PRESETS) >= set(published)


def test_preset_respects_every_explicit_field():
    """An explicit field wins over the preset even when it equals the default (n_layer: 4 with a 6-layer preset)."""
    from quantdyn.config import from_dict

    cfg = resolve_model_config(from_dict(ModelConfig, {"preset": "pythia-70m", "n_layer": 4, "rotary_pct": 0.25,
                                                       "tie_embeddings": False}))
    assert (cfg.n_layer, cfg.d_model, cfg.rotary_pct) == (4, 512, 0.25)
    assert resolve_model_config(ModelConfig(preset="pythia-70m")).n_layer == 6
    assert resolve_model_config(cfg) == cfg  # resolving twice changes nothing
    plain = ModelConfig(vocab_size=64)  # without a preset the defaults apply at once
    assert (plain.n_layer, plain.d_model, plain.ff_dim) == (4, 128, 512)


def test_bad_model_inputs(tmp_path):
    with pytest.raises(QuantdynError, match="must divide"):
        ModelConfig(d_model=30, n_head=4)
    with pytest.raises(QuantdynError, match="did you mean 'pythia-70m'"):
        resolve_model_config(ModelConfig(preset="pythia-70"))
    with pytest.raises(QuantdynError, match="does not exist"):
        load_causal_lm(str(tmp_path / "missing" / "dir"))
    m = _model()
    save_hf(m, tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(QuantdynError, match="corrupt"):
        load_gpt(tmp_path / "ck")
