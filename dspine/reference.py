"""Stateless reference rounds: one speculative round recomputed from scratch (no caches), a chain or a draft tree,
for N rows of equal length. The distribution tests sample them many times; the engine's cached loop
(decode.BatchDecode.step) proposes and verifies through the same functions.
"""

from __future__ import annotations

import torch

from dspine.decoding import DraftTree, propose, propose_tree
from dspine.drafter import DraftOutput, DSpineDraftModel
from dspine.sampling import SamplingParams, warp_probs
from dspine.target import Target
from dspine.verify import verify_chain, verify_sampled, verify_tree_greedy, verify_tree_sampled


@torch.no_grad()
def speculative_step(
    target: Target,
    drafter: DSpineDraftModel,
    seqs: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    verifier=verify_sampled,
):
    """One stateless speculative round for N rows of equal length (full recompute, no caches).

    seqs (N, L): committed tokens, the last one the anchor. Returns (accepted (N,), drafts (N, B-1),
    next (N,)). The distribution tests' reference; the cached loop (decode.BatchDecode) calls the same `propose`
    and verifiers.
    """
    N, L = seqs.shape
    B = drafter.config.block_size
    dev = seqs.device
    _, feats = target.forward(seqs[:, :-1], None, drafter.config.target_layer_ids)
    ctx_pos = torch.arange(L - 1, device=dev).expand(N, -1)
    ctx = drafter.context_kv(feats, ctx_pos)
    pos = torch.arange(L - 1, L - 1 + B, device=dev).expand(N, -1)[:, None]
    out = drafter(drafter.block_inputs(seqs[:, -1:], B), pos, ctx)
    prop = propose(drafter, out, params, generator)
    logits, _ = target.forward(torch.cat([seqs, prop.tokens], 1), None)
    logits = logits[:, L - 1 :]
    n_acc, nxt = verify_chain(prop, logits, params, generator, verifier)
    return n_acc, prop.tokens, nxt


@torch.no_grad()
def speculative_tree_step(
    target: Target,
    drafter: DSpineDraftModel,
    seqs: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """One stateless round through a draft tree for N rows of equal length (full recompute, no caches) ->
    each row's committed tokens (accepted drafts + the next token). seqs (N, L), the last token the anchor. The
    rows' proposals and verdicts come from propose_tree and the tree verifiers one row at a time, as a single
    request's engine round makes them; used by the distribution tests."""
    N, L = seqs.shape
    dev, Bd = seqs.device, tree.depth + 1
    _, feats = target.forward(seqs[:, :-1], None, drafter.config.target_layer_ids)
    ctx = drafter.context_kv(feats, torch.arange(L - 1, device=dev).expand(N, -1))
    pos = torch.arange(L - 1, L - 1 + Bd, device=dev).expand(N, -1)[:, None]
    out = drafter(drafter.block_inputs(seqs[:, -1:], Bd), pos, ctx)

    def row(i: int) -> DraftOutput:
        h_pre = out.h_pre[i : i + 1] if out.h_pre is not None else None
        return DraftOutput(out.hidden[i : i + 1], h_pre, {k: f[i : i + 1] for k, f in out.feats.items()})

    props = [propose_tree(drafter, row(i), tree, params, generator) for i in range(N)]
    n = len(tree.paths)
    att = torch.zeros(L + n, L + n, dtype=torch.bool, device=dev)
    att[:L, :L] = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    att[L - 1 :, : L - 1] = True
    att[L - 1 :, L - 1 :] = tree.mask.to(dev)
    positions = torch.cat([torch.arange(L - 1, device=dev), L - 1 + tree.depths.to(dev)]).expand(N, -1)
    feed = torch.cat([seqs, torch.tensor([toks for toks, _ in props], device=dev)], 1)
    logits, _ = target.forward(feed, None, None, att.expand(N, 1, -1, -1), positions)
    logits = logits[:, L - 1 :]  # (N, n+1, V) at [anchor, nodes]
    got = []
    for i, (toks, q) in enumerate(props):
        if params.greedy:
            path, nxt = verify_tree_greedy(toks, tree.parents, logits[i])
        else:
            path, nxt = verify_tree_sampled(toks, q, tree.parents, warp_probs(logits[i], params), generator)
        got.append([toks[j] for j in path] + [nxt])
    return got
