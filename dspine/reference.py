"""Stateless reference rounds: one speculative round recomputed from scratch (no caches), a chain or a draft tree,
for N rows of equal length. The distribution tests sample them many times; the engine's cached loop
(decode.BatchDecode.step) proposes and verifies through the same functions.
"""

from __future__ import annotations

import torch

from dspine.decoding import DraftTree, merge_drafts, propose, propose_tree, tree_depths, tree_mask
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
    drafter: DSpineDraftModel | None,
    seqs: torch.Tensor,
    tree: DraftTree | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    suffix: list | None = None,
    suffix_nodes: int = 64,
) -> list[list[int]]:
    """One stateless round through a draft tree for N rows of equal length (full recompute, no caches) ->
    each row's committed tokens (accepted drafts + the next token). seqs (N, L), the last token the anchor. Each
    row's tree is the drafter's `tree` (propose_tree; none without a drafter) with `suffix[i]` (a suffix.SuffixDraft,
    or None) merged in (decoding.merge_drafts), verified one row at a time by the tree verifiers, as a single
    request's engine round does; the rows' trees are padded to one width with nodes nothing attends to."""
    N, L = seqs.shape
    dev = seqs.device
    props = [([], [], []) for _ in range(N)]
    if drafter is not None:
        Bd = tree.depth + 1
        _, feats = target.forward(seqs[:, :-1], None, drafter.config.target_layer_ids)
        ctx = drafter.context_kv(feats, torch.arange(L - 1, device=dev).expand(N, -1))
        pos = torch.arange(L - 1, L - 1 + Bd, device=dev).expand(N, -1)[:, None]
        out = drafter(drafter.block_inputs(seqs[:, -1:], Bd), pos, ctx)

        def row(i: int) -> DraftOutput:
            h_pre = out.h_pre[i : i + 1] if out.h_pre is not None else None
            return DraftOutput(out.hidden[i : i + 1], h_pre, {k: f[i : i + 1] for k, f in out.feats.items()})

        props = [(*propose_tree(drafter, row(i), tree, params, generator), list(tree.parents)) for i in range(N)]
    if suffix is not None:
        props = [
            merge_drafts(t, q, par, sd, len(t) + suffix_nodes, 10**6) if sd else (t, q, par)
            for (t, q, par), sd in zip(props, suffix)
        ]
    n = max(1, max(len(t) for t, _, _ in props))
    att = torch.zeros(N, 1, L + n, L + n, dtype=torch.bool, device=dev)
    att[:, 0, :L, :L] = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    att[:, 0, L - 1 :, : L - 1] = True
    positions = torch.arange(L + n, device=dev).repeat(N, 1)
    feed = torch.zeros(N, L + n, dtype=torch.long, device=dev)
    feed[:, :L] = seqs
    for i, (toks, _, parents) in enumerate(props):
        m = len(toks)
        att[i, 0, L - 1 : L + m, L - 1 : L + m] = tree_mask(parents).to(dev)
        att[i, 0, L + m :, L + m :] = torch.eye(n - m, dtype=torch.bool, device=dev)  # padding: itself only
        positions[i, L:] = L - 1 + torch.tensor(tree_depths(parents) + [1] * (n - m), device=dev)
        feed[i, L : L + m] = torch.tensor(toks, dtype=torch.long, device=dev)
    logits, _ = target.forward(feed, None, None, att, positions)
    logits = logits[:, L - 1 :]  # (N, n+1, V) at [anchor, nodes]
    got = []
    for i, (toks, q, parents) in enumerate(props):
        lg = logits[i, : len(toks) + 1]
        if params.greedy:
            path, nxt = verify_tree_greedy(toks, parents, lg)
        else:
            path, nxt = verify_tree_sampled(toks, q, parents, warp_probs(lg, params), generator)
        got.append([toks[j] for j in path] + [nxt])
    return got
