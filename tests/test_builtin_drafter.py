"""The drafter that ships for the built-in target: found by name, complete once loaded (its code table
recomputed from the target), lossless, actually trained, and refused cleanly when it cannot serve."""

import dataclasses
import shutil

import pytest
import torch
from conftest import tiny_target

from dspine.checkpoint import CheckpointError, load_drafter, read_config, resolve_drafter, save_drafter
from dspine.cli import main
from dspine.decoding import DraftTree
from dspine.drafters import builtin_drafter
from dspine.engine import Engine
from dspine.sampling import SamplingParams
from dspine.transfer import build_transfer_space
from dspine.workloads import load_benchmark


@pytest.fixture(scope="module")
def shipped(smollm2):
    return load_drafter(builtin_drafter("smollm2-135m-instruct"), smollm2, dtype=torch.float32)


def test_builtin_resolves_by_name_and_by_default():
    path = builtin_drafter("smollm2-135m-instruct")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert resolve_drafter("builtin", "smollm2-135m-instruct") == str(path)
    assert resolve_drafter(None, "smollm2-135m-instruct", default=True) == str(path)
    assert resolve_drafter(None, "smollm2-135m-instruct") is None
    assert resolve_drafter("none", "smollm2-135m-instruct", default=True) is None
    assert resolve_drafter(None, "/some/hf/folder", default=True) is None
    with pytest.raises(CheckpointError, match="no drafter ships for target '/some/hf/folder'"):
        resolve_drafter("builtin", "/some/hf/folder")


def test_shipped_weights_are_bf16_without_the_code_table(smollm2, shipped):
    from safetensors import safe_open

    with safe_open(str(builtin_drafter("smollm2-135m-instruct") / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert "transfer_codes" not in keys and dtypes == {"BF16"}
    want = build_transfer_space(smollm2.head_weight, shipped.config.transfer_rank).codes
    assert torch.equal(shipped.transfer_codes, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.qint8])
def test_shipped_drafter_is_lossless_and_trained(smollm2, shipped, dtype):
    """Exact AR output at T = 0 on held-out benchmark prompts, and more than one token per round (a drafter
    whose weights were lost or mis-mapped serves tau = 1.0 while still being lossless) — also when it
    drafts in bf16 beside the fp32 target, reading a bf16 copy of the target's head made once, not per call,
    and in int8 (`--draft-dtype auto` on a CPU without native bf16): fp32 weights kept, int8 copies used."""
    path = builtin_drafter("smollm2-135m-instruct")
    drafter = shipped if dtype == torch.float32 else load_drafter(path, smollm2, dtype=dtype)
    stored = torch.float32 if dtype == torch.qint8 else dtype
    assert drafter.fc.weight.dtype == stored and drafter.head.dtype == stored
    assert drafter.int8 == (dtype == torch.qint8)
    spec, ar = Engine(smollm2, drafter), Engine(smollm2)
    taus = []
    for item in load_benchmark("gsm8k", limit=2 if dtype == torch.float32 else 1):
        p = SamplingParams(max_tokens=48)
        r = spec.generate(item.turns[0], p)
        assert r.token_ids == ar.generate(item.turns[0], p).token_ids
        taus.append(r.stats.tau)
    assert sum(taus) / len(taus) > 1.5, taus


def _engine(target, drafter, draft_len, spec_max_batch=None, tree=None, policy=None):
    """The engine `dspine generate`/`serve` build from these options (the CLI's own path: EngineOptions fields)."""
    from argparse import Namespace

    from dspine.cli import engine_from_args

    a = Namespace(draft_len=draft_len, spec_max_batch=spec_max_batch, draft_tree=tree, draft_policy=policy)
    return engine_from_args(a, target, drafter)


def test_generate_on_a_cpu_drafts_through_the_default_tree_losslessly(smollm2):
    """`dspine generate`'s CPU engine: int8 drafts, rounds of one request through CPU_DRAFT_TREE (a chain of its
    --draft-len for batches), exact AR output; --draft-tree none keeps the chain."""
    from dspine.engine import CPU_DRAFT_LEN, CPU_DRAFT_TREE

    drafter = load_drafter(builtin_drafter("smollm2-135m-instruct"), smollm2, dtype=torch.qint8)
    eng = _engine(smollm2, drafter, None)
    assert str(eng.tree) == str(DraftTree.parse(CPU_DRAFT_TREE)) and eng.draft_len == CPU_DRAFT_LEN
    assert _engine(smollm2, drafter, None, tree="none").tree is None
    assert _engine(smollm2, drafter, 2).tree is None  # an explicit --draft-len asks for a chain
    item = load_benchmark("humaneval", limit=1)[0]
    p = SamplingParams(max_tokens=48)
    r = eng.generate(item.turns[0], p)
    assert r.token_ids == Engine(smollm2).generate(item.turns[0], p).token_ids
    assert r.stats.tau > 1.5 and not any(r.stats.accept_hist[eng.tree.depth + 1 :])


def test_default_tree_per_device_fits_the_drafter():
    """Without --draft-len or --draft-tree a single request's rounds verify the CPU's small tree on a CPU and the
    32-node tree elsewhere; a drafter whose block or top_k is too small for the tree gets the chain."""
    from dspine.engine import CPU_DRAFT_TREE, GPU_DRAFT_TREE, default_draft_tree

    cfg = read_config(builtin_drafter("smollm2-135m-instruct"))
    assert default_draft_tree("cpu", cfg) == CPU_DRAFT_TREE
    gpu = DraftTree.parse(default_draft_tree("cuda", cfg))
    assert str(gpu) == str(DraftTree.parse(GPU_DRAFT_TREE)) and len(gpu.paths) == 32 and gpu.depth == 15
    assert default_draft_tree("cuda", dataclasses.replace(cfg, block_size=8)) is None  # depth 15 > 7
    assert default_draft_tree("cuda", dataclasses.replace(cfg, top_k=2)) is None  # rank 2 in the tree
    assert default_draft_tree("cpu", dataclasses.replace(cfg, block_size=8)) == CPU_DRAFT_TREE


def test_codes_present_or_absent_load_the_same(smollm2, shipped, tmp_path):
    full = save_drafter(shipped, tmp_path / "full")  # fp32 with the code table
    slim = save_drafter(shipped, tmp_path / "slim", dtype=torch.bfloat16, derived=False)
    a, b = load_drafter(full, smollm2), load_drafter(slim, smollm2, dtype=torch.float32)
    assert torch.equal(a.transfer_codes, b.transfer_codes)
    with pytest.raises(CheckpointError, match="holds no \\['transfer_codes'\\].*load it with a target"):
        load_drafter(slim)
    assert load_drafter(full).transfer_codes.shape == shipped.transfer_codes.shape  # complete: no target needed


def test_shipped_drafter_refused_for_another_target_or_when_truncated(tmp_path):
    src = builtin_drafter("smollm2-135m-instruct")
    with pytest.raises(CheckpointError, match="drafter was built for vocab 49152 / hidden 576"):
        load_drafter(src, tiny_target("llama"))
    bad = tmp_path / "truncated"
    shutil.copytree(src, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        load_drafter(bad)


def test_cli_uses_the_builtin_drafter(capsys, tmp_path):
    import json

    assert main(["generate", "--prompt", "What is 2 + 2?", "--max-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == "dspine"
    assert main(["generate", "--drafter", "none", "--prompt", "What is 2 + 2?", "--max-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["method"] == "ar"
    assert main(["export", "--to", "sglang", "--drafter", "builtin", "--out", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "model.safetensors").is_file()


def test_cpu_defaults_of_serve_and_generate(smollm2, shipped):
    """On a CPU, serve/generate verify 3 drafts per round unless told otherwise (each draft is a target row there),
    the drafter runs only the block slots that are verified, and batched rounds draft by goodput (or, with
    --draft-policy fixed, rounds of more than 2 open requests decode AR: --spec-max-batch);
    the drafter's dtype: auto is bf16 on a CPU with native bf16 instructions, else int8 there; the target's
    elsewhere."""
    from dspine.checkpoint import CheckpointError, draft_dtype
    from dspine.cli import UsageError, dtype_tag

    got = _engine(smollm2, shipped, None)
    assert (got.draft_len, got.draft_block, got.spec_max_batch, got.policy.K) == (3, 4, None, 3)
    got = _engine(smollm2, shipped, None, policy="fixed")
    assert (got.draft_len, got.draft_block, got.spec_max_batch, got.policy) == (3, 4, 2, None)
    got = _engine(smollm2, shipped, 15, 8)
    assert (got.draft_len, got.draft_block, got.spec_max_batch, got.policy.K) == (15, 16, 8, 15)
    with pytest.raises(UsageError, match="--draft-policy needs a drafter"):
        _engine(smollm2, None, None, policy="goodput")
    assert _engine(smollm2, None, None).method == "ar"
    with pytest.raises(UsageError, match="spec_max_batch must be >= 1"):
        _engine(smollm2, shipped, None, 0)
    with pytest.raises(UsageError, match="draft_len must be in"):
        _engine(smollm2, shipped, 16)
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert draft_dtype("auto", torch.float32, "cpu") == (torch.bfloat16 if native else torch.qint8)
    assert draft_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    assert draft_dtype(None, torch.float32, "cpu") == torch.float32
    assert draft_dtype("int8", torch.float32, "cpu") == torch.qint8 and dtype_tag(str(torch.qint8)) == "int8"
    with pytest.raises(CheckpointError, match="draft dtype 'int4' is not one of"):
        draft_dtype("int4", torch.float32, "cpu")
    with pytest.raises(CheckpointError, match="int8 needs a CPU"):
        draft_dtype("int8", torch.float32, "cuda")
