"""Lossless verification of a drafted block by one causal target forward.

Greedy: accept the longest prefix equal to the target's argmax, then commit the target's own next token.
Sampling: chain rejection sampling against the drafter's actual proposal q — accept draft x_k with
probability min(1, p_k(x)/q_k(x)); at the first rejection sample from norm(max(0, p_k - q_k)); if every
draft passes, the bonus comes from p_B. The committed tokens are then distributed exactly as AR sampling
from p (the warped target distribution, sampling.warp_probs).
Trees: from the anchor, greedy verification follows the child whose token is the target's argmax at its parent,
while one is. Sampled verification is recursive rejection over each node's children: the sampled child x (drawn
from q) first — accepted with probability min(1, p(x)/q(x)), else p becomes norm(max(0, p - q)) — then each
ranked child s in turn, a proposal that is certain of s — accepted with probability p(s), else s's mass is
removed from p and p renormalised; when no child is accepted the next token is drawn from what p has become. Each
step is the chain's rejection step against that child's proposal, so the committed tokens are distributed as AR
sampling's (SpecInfer's multi-candidate verification).
"""

from __future__ import annotations

import torch

from dspine.sampling import SamplingParams, sample, warp_probs


def verify_greedy(draft: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (N, B-1), target logits (N, B, V) at [anchor, drafts] -> (accepted (N,), next token (N,))."""
    tgt = logits.argmax(-1)  # (N, B)
    ok = (draft == tgt[:, :-1]).long()
    n_acc = ok.cumprod(-1).sum(-1)
    return n_acc, tgt.gather(1, n_acc[:, None])[:, 0]


def verify_tree_greedy(tokens: list[int], parents: tuple[int, ...], logits: torch.Tensor) -> tuple[list[int], int]:
    """Node tokens and parent indices (-1: the anchor), target logits (n+1, V) at [anchor, nodes] under the tree
    mask -> (the accepted path's node indices, root first; the target's next token after it)."""
    tgt = logits.argmax(-1).tolist()
    path, row = [], 0  # row: the logits row of the last accepted node (0: the anchor)
    while True:
        nxt = next((i for i, (tok, par) in enumerate(zip(tokens, parents)) if par + 1 == row and tok == tgt[row]), None)
        if nxt is None:
            return path, tgt[row]
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampled(
    tokens: list[int],
    q: list[torch.Tensor | None],
    parents: tuple[int, ...],
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Node tokens, their proposals q (V,) (None: a ranked node), parent indices (-1: the anchor; a parent's
    sampled child listed before its ranked ones), warped target distributions p (n+1, V) at [anchor, nodes]
    under the tree mask -> (the accepted path's node indices, root first; the next token after it)."""
    path, row = [], 0
    while True:
        dist = p[row]
        for i in (i for i, par in enumerate(parents) if par + 1 == row):
            x, u = tokens[i], float(torch.rand((), generator=generator, device=p.device))
            if q[i] is not None:
                if u * float(q[i][x]) < float(dist[x]):
                    break
                resid = (dist - q[i]).clamp_min(0)
            else:
                if u < float(dist[x]):
                    break
                resid = dist.clone()
                resid[x] = 0
            mass = resid.sum()
            dist = resid / mass if mass > 0 else dist
        else:
            return path, int(sample(dist, generator))
        path.append(i)
        row = i + 1


def verify_sampled(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (N, B-1), proposal q (N, B-1, V), warped target p (N, B, V) -> (accepted (N,), next (N,))."""
    N, Bm1 = draft.shape
    px = p[:, :-1].gather(2, draft[..., None])[..., 0]
    qx = q.gather(2, draft[..., None])[..., 0]
    u = torch.rand(N, Bm1, generator=generator, device=draft.device)
    ok = (u * qx < px).long()  # u < p/q  (q(x) > 0: x was sampled from q)
    n_acc = ok.cumprod(-1).sum(-1)
    rows = torch.arange(N, device=draft.device)
    p_at = p[rows, n_acc]  # (N, V) target distribution at the first rejected (or bonus) slot
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n_acc]  # zero at the bonus slot
    resid = (p_at - q_at).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_at)  # p == q: nothing to correct
    return n_acc, sample(resid, generator)


def verify_chain(prop, logits: torch.Tensor, params: SamplingParams, gen, sampled_verifier=verify_sampled):
    """A chain's Proposal (tokens (N, k), q) + the target's logits (N, k+1, V) at [anchor, drafts] -> (accepted (N,),
    next token (N,)): greedy, or rejection sampling against the warped target distribution."""
    if params.greedy:
        return verify_greedy(prop.tokens, logits)
    return sampled_verifier(prop.tokens, prop.q, warp_probs(logits, params), gen)


def verify_forced(drafts: torch.Tensor, ahead: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts (1, k) against a given continuation -> (accepted (1,), next token (1,)); past the end of `ahead`
    nothing is accepted and the next token is a placeholder the stopper never reaches."""
    n = 0
    row = drafts[0].tolist()
    while n < len(row) and n < len(ahead) and row[n] == ahead[n]:
        n += 1
    nxt = ahead[n] if n < len(ahead) else row[0]
    return torch.tensor([n]), torch.tensor([nxt])
