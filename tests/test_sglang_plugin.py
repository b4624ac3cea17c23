"""The SGLang plugin's SGLang-free parts on the CPU: config section, weight split, the injection on SGLang's
flat block layout, and the transition-cache proposal it folds into the draft CUDA graph — checked against
dspine's own drafter and `decoding.propose`, which the lossless tests guard. (SGLang itself runs on the GPU:
tests marked `gpu` in test_sglang_gpu.py.)"""

import json
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch
from conftest import perturb_writes, tiny_target
from safetensors.torch import load_file

from dspine.checkpoint import save_drafter
from dspine.config import ConfigError
from dspine.decoding import propose, transition_scores
from dspine.drafter import DSpineDraftModel, rope_angles
from dspine.sampling import SamplingParams
from dspine.sglang.export import export_sglang
from dspine.sglang.plugin.core import (
    DSpineDraftSampler,
    DSpineSelector,
    candidates,
    inject_flat,
    parse_dspine_config,
    propose_from_state,
    split_weights,
)


def test_entry_point_is_declared_and_loads_without_sglang():
    eps = {e.name: e for e in entry_points(group="sglang.srt.plugins")}
    assert eps["dspine"].value == "dspine.sglang.plugin:register"
    assert callable(eps["dspine"].load())  # SGLang is imported only when SGLang calls it


def _drafter(method, seed=0):
    target = tiny_target("qwen3", layers=6)
    d = DSpineDraftModel.for_target(target, method=method, num_hidden_layers=3, block_size=8, top_k=4)
    return target, perturb_writes(d, seed=seed).eval()


@pytest.mark.parametrize("method", ["dspine", "post_backbone"])
def test_config_and_weights_of_an_export(tmp_path, method):
    _, d = _drafter(method)
    out = export_sglang(save_drafter(d, tmp_path / "ckpt"), tmp_path / "x")
    raw = json.loads((tmp_path / "x" / "config.json").read_text())
    cfg, layers = parse_dspine_config(raw)
    assert layers == d.config.inject_layers and cfg.top_k == 4 and cfg.transfer_rank == d.config.transfer_rank
    weights = load_file(str(tmp_path / "x" / "model.safetensors"))
    mine, rest = split_weights(weights.items(), layers)
    assert set(mine) == {k for k in weights if k.startswith("injections.")} | {"transfer_codes"}
    assert len(mine) + len(rest) == len(weights) == out["weights"]
    # SGLang's DFlash loader would skip what it does not know; the plugin refuses both directions
    with pytest.raises(ValueError, match="injections.7.readout.weight"):
        split_weights([*weights.items(), ("injections.7.readout.weight", torch.zeros(1))], layers)
    with pytest.raises(ValueError, match="lacks DSpine weights"):
        split_weights([(k, v) for k, v in weights.items() if k != "transfer_codes"], layers)
    # bad sections name the problem
    with pytest.raises(ConfigError, match="DFlashDraftModel"):
        parse_dspine_config({**raw, "dspine_config": {**raw["dspine_config"], "method": "dflash"}})
    with pytest.raises(ConfigError, match="unknown key"):
        parse_dspine_config({**raw, "dspine_config": {**raw["dspine_config"], "rank": 3}})
    with pytest.raises(ConfigError, match="no dspine_config"):
        parse_dspine_config({k: v for k, v in raw.items() if k != "dspine_config"})
    # the walk's width is a decode-time setting of the export; the weights stay the checkpoint's
    export_sglang(tmp_path / "ckpt", tmp_path / "k16", top_k=16)
    assert parse_dspine_config(json.loads((tmp_path / "k16" / "config.json").read_text()))[0].top_k == 16
    assert load_file(str(tmp_path / "k16" / "model.safetensors")).keys() == weights.keys()
    with pytest.raises(ConfigError, match="top_k"):
        export_sglang(tmp_path / "ckpt", tmp_path / "k0", top_k=0)
    assert not (tmp_path / "k0").exists()


@pytest.mark.parametrize("method", ["dspine", "post_backbone"])
def test_flat_layout_forward_and_proposal_match_dspine(method):
    """The plugin model's loop (flat bs*B rows, anchor = first row of each block, injection after the
    injecting layers, h_pre/f kept for the proposal) and its sampler give dspine's own drafter forward and
    greedy `propose`, token for token."""
    target, d = _drafter(method, seed=1)
    cfg, B = d.config, d.config.block_size
    g = torch.Generator().manual_seed(0)
    N, C = 3, 11
    ids = torch.randint(0, cfg.vocab_size, (N, C + 1), generator=g)
    with torch.no_grad():
        feats = target.features(ids[:, :C], cfg.target_layer_ids)
        ctx = d.context_kv(feats, torch.arange(C).expand(N, C))
        block = d.block_inputs(ids[:, C:])  # (N, 1, B)
        pos = (C + torch.arange(B)).expand(N, 1, B)
        ref = d(block, pos, ctx)
        want = propose(d, ref, SamplingParams(temperature=0.0)).tokens

        # the plugin's forward, on the flat layout SGLang uses
        flat_ids = block.reshape(-1)
        h = torch.nn.functional.embedding(flat_ids, d._embed)
        anchor_code = d.transfer_codes[flat_ids.view(-1, B)[:, 0]]
        state, last = {}, cfg.num_hidden_layers - 1
        cs = rope_angles(pos.view(N, B), cfg.head_dim, cfg.rope_theta)
        for i, layer in enumerate(d.layers):
            h = layer(h.view(N, B, -1), cs, *ctx[i], None).reshape(N * B, -1)
            if str(i) in d.injections:
                h, f, x = inject_flat(d.injections[str(i)], h, anchor_code, B)
                if i == last:
                    state["h_pre"], state["f"] = x, f
        torch.testing.assert_close(h.view(N, 1, B, -1), ref.hidden, rtol=0, atol=0)
        model = SimpleNamespace(
            dspine_state=state,
            inject_layers=cfg.inject_layers,
            injections=d.injections,
            norm_for_scores=d.norm,
            transfer_codes=d.transfer_codes,
            dspine=SimpleNamespace(top_k=cfg.top_k),
        )
        sampler = DSpineDraftSampler(model, d.head, B, max_bs=8)
        sampler(d.norm(h), flat_ids)
    got = sampler.out[: N * (B - 1)].view(N, B - 1)
    assert torch.equal(got, want)

    # SGLang >= 0.5.23: the same transition cache offered as DFLASH's candidate-selector lattice, which SGLang
    # walks itself (greedy, or sampled with q): its greedy walk gives the same tokens
    K = cfg.top_k
    model.lm_head = SimpleNamespace(weight=d.head)
    with torch.no_grad():
        slots = d.norm(h).view(N, B, -1)[:, 1:]
        cand, unary = candidates(slots.reshape(N * (B - 1), -1), d.head, K)
        cand, unary = cand.view(N, B - 1, K), unary.view(N, B - 1, K)
        sel = DSpineSelector(model, sample_path=lambda self, **kw: (self, kw))
        lattice = sel.build_lattice(
            candidate_ids=cand, unary_logits=unary, hidden_states=slots, anchor_token_ids=flat_ids.view(N, B)[:, 0]
        )
        want_S = transition_scores(
            d.injections[str(last)],
            d.norm,
            d.head,
            d.transfer_codes,
            state["h_pre"].view(N, B, -1),
            state["f"].view(N, B, -1),
            cand,
        )
    assert lattice.shape == (N, B - 1, K, K) and lattice.dtype == torch.float32
    torch.testing.assert_close(lattice[:, 1:], want_S, rtol=0, atol=0)
    assert torch.equal(lattice[:, 0], unary[:, :1].expand(N, K, K))  # slot 1: its own logits, whatever p
    rows, idx = torch.arange(N), lattice[:, 0, 0].argmax(-1)
    path = [idx]
    for e in range(1, B - 1):  # SGLang's greedy walk: argmax along the row of the chosen predecessor
        idx = lattice[rows, e, idx].argmax(-1)
        path.append(idx)
    assert torch.equal(cand.gather(-1, torch.stack(path, 1)[..., None])[..., 0], want)
    assert sel.sample_path(uniforms=1) == (sel, {"uniforms": 1}) and sel.top_k == K  # SGLang's own walk
    # the proposal is not just DFlash's per-slot argmax: the walk changed at least one slot here
    with torch.no_grad():
        argmax = d.logits(ref.hidden[:, 0, 1:]).argmax(-1)
    assert not torch.equal(got, argmax)
    # the eager path SGLang takes without a draft CUDA graph gives the same tokens
    eager = propose_from_state(model, d.norm(h).view(N, B, -1)[:, 1:], d.head)
    assert torch.equal(eager.view(N, B - 1), want)
    # SGLang pads its lm_head past the vocabulary; padding rows never become candidates (here they would win)
    with torch.no_grad():
        padded = torch.cat([d.head, 100 * slots.reshape(N * (B - 1), -1)])  # each slot's own row would win
        sampler = DSpineDraftSampler(model, padded, B, max_bs=8)
        sampler(d.norm(h), flat_ids)
        eager = propose_from_state(model, slots, padded)
    assert torch.equal(sampler.out[: N * (B - 1)].view(N, B - 1), want)
    assert torch.equal(eager.view(N, B - 1), want)


def test_flat_injection_takes_sglangs_split_stream_and_proposes_without_autograd(monkeypatch):
    """SGLang's layers hand the stream over as (h, residual): the injection of h + residual given apart equals
    the injection of the summed stream, and returns that stream (the transition cache's h_pre). SGLang calls
    the draft sampler outside the model's no_grad, where the fused kernels (no backward) would be passed over:
    the proposal turns autograd off itself."""
    import dspine.sglang.plugin.core as core

    _, d = _drafter("dspine", seed=2)
    B, last = d.config.block_size, str(d.config.num_hidden_layers - 1)
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(2 * B, d.config.hidden_size, generator=g) for _ in range(2))
    anc = torch.randn(2, d.config.transfer_rank, generator=g)
    with torch.no_grad():
        out, f, x = inject_flat(d.injections[last], a, anc, B, residual=b)
        whole = a + b
        out2, f2, x2 = inject_flat(d.injections[last], whole, anc, B)
    assert torch.equal(x, whole) and x2 is whole and torch.equal(out, out2) and torch.equal(f, f2)
    assert not torch.equal(out, x)  # the write changed the stream

    grad_on = []
    walk = core.greedy_transition_walk
    monkeypatch.setattr(core, "greedy_transition_walk", lambda *a: grad_on.append(torch.is_grad_enabled()) or walk(*a))
    model = SimpleNamespace(
        dspine_state={"h_pre": x, "f": f},
        inject_layers=d.config.inject_layers,
        injections=d.injections,
        norm_for_scores=d.norm,
        transfer_codes=d.transfer_codes,
        dspine=SimpleNamespace(top_k=d.config.top_k),
    )
    assert torch.is_grad_enabled()
    toks = propose_from_state(model, d.norm(out).view(2, B, -1)[:, 1:], d.head)
    assert grad_on == [False] and toks.shape == (2 * (B - 1),) and torch.is_grad_enabled()


def test_round_timing_totals_and_split(tmp_path):
    """The plugin's round timer (CUDA events in SGLang; here events on a simulated GPU clock): decode rounds and
    prefills are told apart, the draft and verify spans inside a round are summed, only events the GPU has
    passed are read (never a blocking sync), a prefill flushes, and the file holds totals whose difference
    gives the split of the rounds in between (what `dspine bench --backend sglang` reports per concurrency)."""
    from types import SimpleNamespace

    from dspine.sglang.plugin import timing

    clock = {"enqueued": 0.0, "gpu": 0.0}

    class Event:  # recorded at the enqueue clock; complete once the simulated GPU has passed it
        def __init__(self):
            self.t = clock["enqueued"]

        def query(self):
            return self.t <= clock["gpu"]

        def elapsed_time(self, other):
            return other.t - self.t

    def mode(extend):
        return SimpleNamespace(is_idle=lambda: False, is_extend=lambda: extend)

    path = tmp_path / "t" / "dspine.json"
    timer = timing.RoundTimer(str(path), every=3, event=Event)
    worker = SimpleNamespace(draft_model_runner=object())

    def spend(ms):
        clock["enqueued"] += ms

    def decode_round(w, batch):  # 1 ms glue, 2 ms draft, 3 ms verify, 0.5 ms glue
        spend(1.0)
        timer.draft(lambda r: spend(2.0), w.draft_model_runner)
        timer.draft(lambda r: spend(7.0), object())  # another runner (the target's): not a draft span
        timer.verify(lambda tw, is_verify: spend(3.0), None, is_verify=True)
        spend(0.5)

    for _ in range(2):
        timer.round(decode_round, worker, SimpleNamespace(forward_mode=mode(False)))
    assert not path.exists()  # fewer than `every` events: nothing read yet
    timer.round(lambda w, b: spend(4.0), worker, SimpleNamespace(forward_mode=mode(True)))  # a prefill
    assert not path.exists()  # the GPU has not passed the rounds yet: flushing does not wait for them
    clock["gpu"] = clock["enqueued"]
    timer.round(decode_round, worker, SimpleNamespace(forward_mode=mode(False)))  # 4th event: read 3, keep 1
    first = json.loads(path.read_text())
    assert first["totals"]["rounds"] == 2 and first["totals"]["extends"] == 1 and len(timer.pending) == 1
    assert first["round_ms"] == 13.5 and first["draft_ms"] == 2.0 and first["verify_ms"] == 3.0
    assert first["glue_ms"] == 8.5 and first["extend_total_ms"] == 4.0  # the other runner's 7 ms is glue
    clock["gpu"] = clock["enqueued"]
    timer.round(lambda w, b: spend(1.0), worker, SimpleNamespace(forward_mode=mode(True)))  # flushes the round
    second = json.loads(path.read_text())
    between = timing.split(second["totals"], first["totals"])
    assert between["rounds"] == 1 and between["extends"] == 0 and between["round_ms"] == 13.5
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["dspine.json"]  # no temp file left behind


def _tp_rank(rank, world, rdv, bounds, args, out_dir):
    """One tensor-parallel rank (gloo on CPU, SGLang's group interface): its padded vocabulary shard of the head
    -> the plugin's proposal, and the merged candidates."""
    import torch.distributed as dist

    from dspine.sglang.plugin.core import VocabShard

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)

    class Group:  # what the plugin uses of SGLang's GroupCoordinator
        world_size = world

        def all_gather_into_tensor(self, out, inp):
            dist.all_gather(list(out.chunk(world)), inp)

        def all_reduce(self, t):
            dist.all_reduce(t)
            return t

    model, slots, head = args
    lo, hi = bounds[rank], bounds[rank + 1]
    # SGLang pads each shard past its real rows; padding that would win must never become a candidate
    padded = torch.cat([head[lo:hi], 100 * slots.reshape(-1, head.shape[1])[:3]])
    shard = VocabShard(padded, hi - lo, lo, Group())
    with torch.no_grad():
        toks = propose_from_state(model, slots, shard)
        cand, vals = shard.top_candidates(slots.reshape(-1, head.shape[1]), model.dspine.top_k, fast=False)
    torch.save({"toks": toks, "cand": cand, "vals": vals}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("bounds", [(0, 37, None), (0, 5, 64, None)], ids=["tp2", "tp3-uneven"])
def test_tensor_parallel_ranks_propose_what_one_head_does(tmp_path, bounds):
    """Under SGLang's --tp-size N the target's head is sharded by vocabulary (contiguous, each shard padded): the
    ranks' merged top-K equals the full head's, their summed transition tables give the same walk, and every
    rank proposes the single-GPU tokens — here on N gloo processes, with a shard smaller than K (tp3-uneven)."""
    import torch.multiprocessing as mp

    _, d = _drafter("dspine", seed=3)
    cfg, B, N = d.config, d.config.block_size, 4
    g = torch.Generator().manual_seed(7)
    V = cfg.vocab_size
    bounds = [b if b is not None else V for b in bounds]
    a, anc = torch.randn(N * B, cfg.hidden_size, generator=g), torch.randn(N, cfg.transfer_rank, generator=g)
    last = str(cfg.num_hidden_layers - 1)
    with torch.no_grad():
        out, f, x = inject_flat(d.injections[last], a, anc, B)
        slots = d.norm(out).view(N, B, -1)[:, 1:].contiguous()
    model = SimpleNamespace(
        dspine_state={"h_pre": x, "f": f},
        inject_layers=cfg.inject_layers,
        injections=d.injections,
        norm_for_scores=d.norm,
        transfer_codes=d.transfer_codes,
        dspine=SimpleNamespace(top_k=cfg.top_k),
    )
    head = d.head.detach().clone()
    want = propose_from_state(model, slots, head)
    want_cand, want_vals = candidates(slots.reshape(N * (B - 1), -1), head, cfg.top_k)
    world = len(bounds) - 1
    mp.spawn(_tp_rank, args=(world, tmp_path / "rdv", bounds, (model, slots, head), tmp_path), nprocs=world)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for r in got:
        assert torch.equal(r["toks"], want)  # every rank walks to the single-GPU tokens
        assert torch.equal(r["cand"], want_cand)
        torch.testing.assert_close(r["vals"], want_vals, rtol=1e-6, atol=1e-6)  # a shard's matmul, not the full one
    # not a vacuous agreement: the candidates come from more than one shard
    owner = torch.bucketize(want_cand, torch.tensor(bounds[1:-1]), right=True)
    assert owner.unique().numel() > 1


def test_vocab_shard_of_sglangs_head_and_its_refusals():
    """One rank: the head's first `vocab` rows, whatever SGLang's shard metadata; under TP the shard's range,
    and a clear error where the range is unknown, has added rows, or runs past the drafter's codes."""
    from dspine.sglang.plugin.core import VocabShard

    w = torch.randn(40, 8)
    two = SimpleNamespace(world_size=2)

    def head(start, n, added=0):
        shard = SimpleNamespace(org_vocab_start_index=start, num_org_elements=n, num_added_elements=added)
        return SimpleNamespace(weight=w, shard_indices=shard)

    one = VocabShard.of(head(0, 40), 32, SimpleNamespace(world_size=1))
    assert one.group is None and one.start == 0 and one.weight.shape[0] == 32
    tp = VocabShard.of(head(32, 30), 64, two)
    assert tp.group is two and tp.start == 32 and tp.weight.shape[0] == 30
    with pytest.raises(ValueError, match="without shard_indices"):
        VocabShard.of(SimpleNamespace(weight=w), 64, two)
    with pytest.raises(ValueError, match="added vocabulary"):
        VocabShard.of(head(0, 30, added=2), 64, two)
    with pytest.raises(ValueError, match="past the drafter's 50 codes"):
        VocabShard.of(head(32, 30), 50, two)
    with pytest.raises(ValueError, match="needs its tensor-parallel group"):
        VocabShard(w, 30, start=32)
