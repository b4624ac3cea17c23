"""`dspine export --to sglang`: DFlash's config fields and weight names, validated name by name."""

import json

import pytest
import torch
from conftest import tiny_target
from safetensors.torch import load_file, save_file

from dspine.checkpoint import save_drafter
from dspine.cli import main
from dspine.drafter import DSpineDraftModel
from dspine.sglang.export import ExportError, validate_sglang_export


@pytest.mark.parametrize("method,arch", [("dspine", "DSpineDraftModel"), ("dflash", "DFlashDraftModel")])
def test_export_for_sglang(tmp_path, method, arch):
    target = tiny_target("qwen3")
    d = DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=8)
    ckpt = save_drafter(d, tmp_path / "ckpt")
    assert main(["export", "--to", "sglang", "--drafter", str(ckpt), "--out", str(tmp_path / "x")]) == 0
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["block_size"] == 8 and cfg["torch_dtype"] == "bfloat16"
    assert (
        cfg["dflash_config"]["mask_token_id"] == 0
        and cfg["dflash_config"]["target_layer_ids"] == d.config.target_layer_ids
        and cfg["num_target_layers"] == 6
    )
    w = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert w["layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    assert ("transfer_codes" in w) == (method == "dspine")
    if method == "dspine":
        assert w["transfer_codes"].dtype == torch.float32
        assert {k for k in w if k.startswith("injections.")} == {
            f"injections.{i}.{n}"
            for i in (0, 1)
            for n in (
                "readout.weight",
                "readout.bias",
                "gate_f.weight",
                "gate_f.bias",
                "gate_p.weight",
                "message.weight",
                "write.weight",
            )
        }
    # an extra or a missing name is an error that names it (SGLang would skip it silently)
    save_file(
        {**w, "layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}, str(tmp_path / "x" / "model.safetensors")
    )
    with pytest.raises(ExportError, match="rotary_emb"):
        validate_sglang_export(tmp_path / "x")
    save_file({k: v for k, v in w.items() if k != "fc.weight"}, str(tmp_path / "x" / "model.safetensors"))
    with pytest.raises(ExportError, match="fc.weight"):
        validate_sglang_export(tmp_path / "x")
    # restored, it validates again
    save_file(w, str(tmp_path / "x" / "model.safetensors"))
    assert validate_sglang_export(tmp_path / "x")["architecture"] == arch


def test_export_bad_input(tmp_path, capsys):
    assert main(["export", "--drafter", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err and not (tmp_path / "x").exists()
