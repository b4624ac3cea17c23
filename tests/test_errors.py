"""Bad input gets one clear error that names the problem."""

import json

import pytest
from conftest import tiny_target

from dspine.checkpoint import CheckpointError, load_drafter, save_drafter
from dspine.drafter import DSpineDraftModel
from dspine.engine import Engine
from dspine.sampling import RequestError, SamplingParams


@pytest.fixture()
def saved(tmp_path):
    target = tiny_target("llama")
    d = DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=8)
    return target, save_drafter(d, tmp_path / "ckpt")


def test_drafter_for_another_vocab(saved):
    _, path = saved
    with pytest.raises(CheckpointError, match="vocab 128.*vocab 256"):
        load_drafter(path, tiny_target("llama", vocab=256))


def test_drafter_for_another_hidden_size(saved):
    _, path = saved
    with pytest.raises(CheckpointError, match="hidden 64.*hidden 96"):
        load_drafter(path, tiny_target("llama", hidden=96))


def test_engine_rejects_mismatched_drafter(saved):
    target, _ = saved
    other = DSpineDraftModel.for_target(tiny_target("qwen3", vocab=200), num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocab 200"):
        Engine(target, other)


def _edit_config(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_config_keys(saved):
    _, path = saved
    _edit_config(path, lambda c: c["dspine_config"].update(transfer_rnak=64))
    with pytest.raises(CheckpointError, match="transfer_rnak"):
        load_drafter(path)
    _edit_config(path, lambda c: (c["dspine_config"].pop("transfer_rnak"), c.update(hiden_size=3)))
    with pytest.raises(CheckpointError, match="hiden_size"):
        load_drafter(path)


def test_truncated_safetensors(saved):
    _, path = saved
    w = path / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_drafter(path)


def test_pickle_checkpoints_are_refused(saved):
    _, path = saved
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_drafter(path)


def test_mismatched_weight_shapes(saved):
    _, path = saved
    _edit_config(path, lambda c: c.update(intermediate_size=100))
    with pytest.raises(CheckpointError, match="shapes do not match"):
        load_drafter(path)


def test_empty_prompt_and_bad_max_tokens(saved):
    target, path = saved
    eng = Engine(target, load_drafter(path, target))
    with pytest.raises(RequestError, match="prompt is empty"):
        eng.generate([], SamplingParams(max_tokens=4))
    for bad in (0, -3):
        with pytest.raises(RequestError, match="max_tokens must be a positive integer"):
            eng.generate([1, 2, 3], SamplingParams(max_tokens=bad))
    with pytest.raises(RequestError, match="temperature"):
        eng.generate([1, 2, 3], SamplingParams(temperature=-1))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.generate([1, 999], SamplingParams())
    assert eng.generate([1, 2, 3], SamplingParams(max_tokens=3)).completion_tokens == 3  # still usable


def test_save_is_atomic_and_replaces(saved, tmp_path):
    target, path = saved
    d = DSpineDraftModel.for_target(target, method="dflash", num_hidden_layers=1, block_size=4)
    save_drafter(d, path)
    assert load_drafter(path, target).config.method == "dflash"
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]  # no temp folders left
