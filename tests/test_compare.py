"""`dflash-jax compare` against transformers on tiny random targets: near-zero differences in float32,
and a planted defect (one layer's weight perturbed on our side only) named by the report."""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from dflash_jax import cli
from dflash_jax import compare as cmp
from tests.hf_models import save_and_convert, tiny_hf_model

IDS = [3, 17, 42, 5, 99, 8, 61, 20, 33, 71, 2, 90]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, tmp_path_factory):
    model = tiny_hf_model(request.param)
    cfg, params = save_and_convert(model, tmp_path_factory.mktemp(request.param))
    return model, cfg, params


def test_float32_agrees(pair):
    model, cfg, params = pair
    report = cmp.compare_target(params, cfg, model, IDS, tokens=12)
    assert len(report["layers"]) == cfg.num_layers
    assert report["first_bad_layer"] is None
    assert max(r["rel"] for r in report["layers"]) < 1e-5
    assert min(r["cosine"] for r in report["layers"]) > 1 - 1e-9
    assert report["logits"]["top1_agreement"] == 1.0
    assert report["logits"]["kl_max"] < 1e-8
    assert report["greedy"]["first_difference"] is None
    assert report["greedy"]["ours"] == report["greedy"]["reference"]
    assert report["verdict"].startswith("agree")


def _perturb_layer(params, layer: int):
    """Our params with one layer's MLP down projection scaled (the PyTorch side keeps the original)."""
    layers = list(params.layers)
    lp = layers[layer]
    layers[layer] = dataclasses.replace(lp, mlp=dataclasses.replace(lp.mlp, down=lp.mlp.down * 1.05))
    return dataclasses.replace(params, layers=tuple(layers) if isinstance(params.layers, tuple) else layers)


def test_planted_defect_names_the_layer(pair):
    model, cfg, params = pair
    bad = cfg.num_layers - 2
    report = cmp.compare_target(_perturb_layer(params, bad), cfg, model, IDS, tokens=4)
    assert report["first_bad_layer"] == bad
    assert all(r["rel"] < 1e-5 for r in report["layers"][:bad])
    assert f"layer {bad}" in report["verdict"] and report["verdict"].startswith("real disagreement")
    assert "<- first past tolerance" in cmp.format_table(report).splitlines()[bad + 1]


def test_parting_verdicts():
    """Swapped top two within rounding: a near-tie; a wide gap or other tokens: a real disagreement."""
    assert cmp._margin(np.array([0.0, 5.0, 5.001, 1.0])) == ([2, 1], pytest.approx(0.001, abs=1e-6))
    assert cmp.classify_parting(3, [2, 1], 0.001, [1, 2], 0.002, 0.01).startswith("near-tie")
    assert cmp.classify_parting(3, [2, 1], 0.5, [1, 2], 0.002, 0.01).startswith("real disagreement")
    assert cmp.classify_parting(3, [2, 1], 0.001, [1, 7], 0.002, 0.01).startswith("real disagreement")


def test_cli_writes_json_and_png(pair, tmp_path, capsys, monkeypatch):
    model, cfg, params = pair
    directory = tmp_path / "hf"
    model.save_pretrained(directory)
    # The tiny model has no tokenizer: feed the ids straight through.
    monkeypatch.setattr(cli, "_load_target", lambda name, dtype, flag="--model": (cfg, params, None))
    monkeypatch.setattr("dflash_jax.pipeline.encode_prompts", lambda tok, texts, chat=True: [IDS for _ in texts])
    out = tmp_path / "out"
    assert cli.main(["compare", "--model", str(directory), "--prompt", "x", "--tokens", "5", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "verdict: agree" in table
    report = json.loads((out / "compare.json").read_text())["reports"][0]
    assert report["first_bad_layer"] is None and len(report["layers"]) == cfg.num_layers
    assert (out / "compare_layers.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_package_is_one_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(ValueError, match=r"needs torch: pip install 'dflash-jax\[compare\]'"):
        cmp.require_reference("torch")
    assert cli.main(["compare", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dflash==0.1.0" in err and "needs torch" in err


def test_drafter_depths_agree_and_a_defect_shows(tmp_path):
    """dflash 0.1.0's drafter on the same context features: per-depth logits agree in float32; a
    perturbed drafter layer on our side moves every depth past tolerance."""
    pytest.importorskip("dflash.model")
    from tests import spec_models

    target, drafter = spec_models.target_model(), spec_models.drafter_model(block_size=4)
    cfg, params, dcfg, dparams = spec_models.convert_pair(target, drafter, tmp_path)
    ids = [3, 7, 1, 9, 12, 5, 8, 2, 11]
    report = cmp.compare_drafter(params, cfg, dparams, dcfg, target, drafter, ids)
    assert [r["depth"] for r in report["depths"]] == [1, 2, 3]
    assert report["first_bad_depth"] is None
    assert all(r["rel"] < 1e-5 and r["top1_agree"] for r in report["depths"])
    layers = list(dparams.layers)
    layers[0] = dataclasses.replace(layers[0], mlp=dataclasses.replace(layers[0].mlp,
                                                                      down=layers[0].mlp.down * 1.1))
    bad = dataclasses.replace(dparams, layers=type(dparams.layers)(layers))
    report = cmp.compare_drafter(params, cfg, bad, dcfg, target, drafter, ids)
    assert report["first_bad_depth"] == 1
