"""From a drafter forward to a proposed block: independent per-slot choice (DFlash) or the transition
cache + left-to-right walk (DSpine, post-backbone). These are the eager references for
kernels/transition.py.

Transition cache: keep h_pre_t (slot t before the last layer's write) and f_t (its last-layer readout).
Candidates C_t = top-K of slot t's unconditioned logits. For every slot t >= 2 and predecessor a in C_{t-1}
the last write is redone with the decoded code T[a]:
    h'_{t|a} = h_pre_t + W_L(σ(A f_t + P T[a] + b) ⊙ M T[a]),   S_t[a, b] = <W_out[b], norm(h'_{t|a})>, b in C_t
— all (B-2)·K·K scores in one batched pass. The walk is then a table lookup per slot.

Sampling: slot 1 (whose predecessor, the anchor, is already decoded) samples from its full warped
distribution; its candidate set is made to contain the sampled token (it replaces the K-th candidate), so
the walk can continue. Slots >= 2 sample from the warped scores over their K candidates. The proposal
distribution q returned is exactly what each token was sampled from — what lossless verification needs.

Draft trees: the same table ranks every slot's candidates after each candidate of the slot before, so a static
tree of rank paths costs no extra drafter work — "0000.1.01" is the walk's chain of 4, plus slot 1's second
candidate, plus the second-best successor of slot 1's first (`DraftTree`); the target verifies all of its nodes
in one forward under a tree mask (verify.verify_tree_greedy). When sampling, the rank-0 chain is the sampled walk
(its proposals q kept) and a rank r >= 1 below it is the r-th best candidate other than the sampled one; below a
ranked node everything is ranked (verify.verify_tree_sampled).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from dspine import kernels
from dspine.drafter import DraftOutput, DSpineDraftModel, Injection
from dspine.sampling import SamplingParams, sample, sample_inverse_cdf, warp_probs


@dataclass
class Proposal:
    tokens: torch.Tensor  # (N, B-1) drafts for slots 1..B-1
    q: torch.Tensor | None  # (N, B-1, V) proposal distributions (sampling), None when greedy


def transition_scores(
    inj: Injection,
    norm: torch.nn.Module,
    head: torch.Tensor,
    codes: torch.Tensor,
    h_pre: torch.Tensor,
    f: torch.Tensor,
    cand: torch.Tensor,
) -> torch.Tensor:
    """h_pre (N, B, d), f (N, B, r), cand (N, B-1, K) candidates of slots 1..B-1
    -> S (N, B-2, K, K): S[:, t-2, i, j] = score of cand[slot t, j] after predecessor cand[slot t-1, i]."""
    pred = codes[cand[:, :-1]].to(h_pre.dtype)  # (N, B-2, K, r) codes of slots 1..B-2's candidates
    # A f_t is shared by the K predecessors: (N, B-2, 1, r) broadcasts against pred inside delta
    h = h_pre[:, 2:, None, :] + inj.delta(f[:, 2:, None, :], pred)  # (N, B-2, K, d)
    succ = head[cand[:, 1:]].to(h.dtype)  # (N, B-2, K, d) rows of slots 2..B-1's candidates
    return torch.matmul(norm(h), succ.transpose(-1, -2)).float()


def walk_greedy(cand: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """cand (N, B-1, K), S (N, B-2, K, K) -> tokens (N, B-1); slot 1 takes its top candidate."""
    N, Bm1, _ = cand.shape
    rows = torch.arange(N, device=cand.device)
    idx = torch.zeros(N, dtype=torch.long, device=cand.device)
    out = [cand[:, 0, 0]]
    for j in range(Bm1 - 1):
        idx = S[rows, j, idx].argmax(-1)
        out.append(cand[rows, j + 1, idx])
    return torch.stack(out, dim=1)


def walk_sample(
    cand: torch.Tensor,
    S: torch.Tensor,
    first_idx: torch.Tensor,
    params: SamplingParams,
    vocab: int,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled walk for slots 2..B-1 -> tokens (N, B-2), q (N, B-2, V) dense proposal distributions.
    With `uniforms` (N, B-2) the draws are inverse-CDF (the reference of kernels/transition.py)."""
    N, Bm1, K = cand.shape
    rows = torch.arange(N, device=cand.device)
    idx = first_idx
    toks, qs = [], []
    for j in range(Bm1 - 1):
        probs = warp_probs(S[rows, j, idx], params)  # (N, K) over slot j+2's candidates
        idx = sample(probs, generator) if uniforms is None else sample_inverse_cdf(probs, uniforms[:, j])
        toks.append(cand[rows, j + 1, idx])
        qs.append(torch.zeros(N, vocab, device=cand.device).scatter_(1, cand[:, j + 1], probs))
    if not toks:
        return cand.new_zeros(N, 0), torch.zeros(N, 0, vocab, device=cand.device)
    return torch.stack(toks, 1), torch.stack(qs, 1)


def scores_table(
    inj: Injection,
    norm: torch.nn.Module,
    head: torch.Tensor,
    codes: torch.Tensor,
    h_pre: torch.Tensor,
    f: torch.Tensor,
    cand: torch.Tensor,
    fast: bool,
) -> torch.Tensor:
    """transition_scores, or its fused kernel (`fast`), or on CUDA above that kernel's width and from
    kernels.transition.LOWRANK_MIN_BLOCKS blocks its s-wide form (DSPINE_TRANSITION=auto|eager|lowrank);
    no slot >= 2 (B = 2) -> an empty table."""
    N, Bm1, K = cand.shape
    if Bm1 == 1:
        return torch.zeros(N, 0, K, K, device=cand.device)
    if fast:
        from dspine.kernels.transition import fused_transition_scores

        return fused_transition_scores(inj, norm, head, codes, h_pre, f, cand)
    if kernels.enabled(h_pre):
        from dspine.kernels.transition import lowrank_transition_scores, lowrank_wanted

        if lowrank_wanted(N):
            return lowrank_transition_scores(inj, norm, head, codes, h_pre, f, cand)
    return transition_scores(inj, norm, head, codes, h_pre, f, cand)


def top_candidates(
    hidden: torch.Tensor, head: torch.Tensor, k: int, fast: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, d) normed draft states, head (V, d) -> the K best ids (N, K) and their logits (N, K) fp32,
    best first: the candidate sets C_t. `fast`: kernels/candidates.py (no (N, V) logits written) where it
    was measured faster, else its tiled top-K over cuBLAS logits (candidates.choice; DSPINE_CANDIDATES overrides)."""
    if fast:
        from dspine.kernels.candidates import choice, fused_top_candidates, tiled_top_candidates

        how = choice(k, *hidden.shape)
        if how == "fused":
            return fused_top_candidates(hidden, head, k)
        if how == "tiled":
            return tiled_top_candidates(hidden, head, k)
    vals, ids = torch.matmul(hidden, head.t().to(hidden.dtype)).topk(min(k, head.shape[0]), dim=-1)
    return ids, vals.float()


def greedy_transition_walk(
    cand: torch.Tensor,
    inj: Injection,
    norm: torch.nn.Module,
    head: torch.Tensor,
    codes: torch.Tensor,
    h_pre: torch.Tensor,
    f: torch.Tensor,
) -> torch.Tensor:
    """cand (N, B-1, K) candidates of slots 1..B-1, best first; h_pre (N, B, d), f (N, B, r) -> greedy drafts
    (N, B-1): slot 1 its argmax, slots >= 2 through the transition cache (the fused kernels on CUDA). The
    engine's and the SGLang plugin's greedy proposal."""
    return walk_table(cand, scores_table(inj, norm, head, codes, h_pre, f, cand, kernels.fused_width_ok(h_pre)))


def walk_table(cand: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """walk_greedy, fused on CUDA (the walk reads only cand and S: fused at any width)."""
    if kernels.enabled(cand):
        from dspine.kernels.transition import fused_walk_greedy

        return fused_walk_greedy(cand, S)
    return walk_greedy(cand, S)


@dataclass(frozen=True)
class DraftTree:
    """A static draft tree of rank paths: node (r1, ..., rt) is the r_t-th best candidate of slot t after its
    parent's token (slot 1: r1-th of slot 1's own candidates; 0 = best), ranked by the transition table, or by
    each slot's own logits for a drafter without one. `parse` takes the leaves, '.'-separated digit strings
    ("0000.1.01"), and adds every prefix; nodes are kept parents first (by depth, then rank)."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, spec: str) -> DraftTree:
        leaves = [x.strip() for x in str(spec).split(".")]
        if not all(x.isdigit() for x in leaves):
            raise ValueError(f"draft tree {spec!r}: leaves are '.'-separated strings of rank digits, e.g. 0000.1.01")
        nodes = {tuple(int(c) for c in x[:n]) for x in leaves for n in range(1, len(x) + 1)}
        return cls(tuple(sorted(nodes, key=lambda p: (len(p), p))))

    def __str__(self) -> str:
        leaves = [p for p in self.paths if not any(q[:-1] == p for q in self.paths)]
        return ".".join("".join(map(str, p)) for p in sorted(leaves))

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @property
    def max_rank(self) -> int:
        return max(max(p) for p in self.paths)

    def fits(self, cfg) -> bool:
        """Whether a drafter of this config can draft the tree: depth below its block size, ranks below its top_k."""
        return self.depth < cfg.block_size and self.max_rank < cfg.top_k

    @classmethod
    def for_drafter(cls, tree: DraftTree | str, cfg) -> DraftTree:
        """A tree (or its spec) that a drafter of config `cfg` (None: no drafter) can draft; ValueError naming
        what it needs otherwise."""
        tree = tree if isinstance(tree, DraftTree) else cls.parse(tree)
        if cfg is None or not tree.fits(cfg):
            B = cfg.block_size if cfg is not None else 1
            raise ValueError(
                f"draft tree {tree}: needs a drafter, depth in [1, {B - 1}] (block size {B}) and ranks below the "
                f"drafter's top_k ({cfg.top_k if cfg is not None else '-'})"
            )
        return tree

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Each node's parent node index; -1: the anchor."""
        at = {p: i for i, p in enumerate(self.paths)}
        return tuple(at[p[:-1]] if len(p) > 1 else -1 for p in self.paths)

    @cached_property
    def depths(self) -> torch.Tensor:
        """(n+1,) positions after the anchor's: 0 for the anchor, then each node's depth."""
        return torch.tensor([0] + [len(p) for p in self.paths])

    def prune(self, rates, nodes: int) -> DraftTree:
        """The best subtree of at most `nodes` nodes, from each node's acceptance rate measured through this
        tree (per round, in paths order: `engine.TreeProfile`); a node never accepted is never kept. A node
        enters only after its parent and its next-better sibling: siblings are verified best first and a child
        only below its accepted parent, so each kept node is accepted as often in the subtree as it was here
        (but for the drafter running fewer block slots under a shallower tree), and the subtree's τ is 1 + the
        sum of its kept rates. Greedy over that frontier, best rate first (the static-tree criterion of Sequoia
        and EAGLE-2: expected accepted tokens per verified node)."""
        if len(rates) != len(self.paths) or nodes < 1:
            raise ValueError(f"prune: one rate per node ({len(self.paths)}) and nodes >= 1")
        return DraftTree.of(self.greedy_order(rates)[:nodes])

    def greedy_order(self, rates) -> list[tuple[int, ...]]:
        """The nodes in the order `prune` takes them (each prefix is a subtree); nodes never accepted left out."""
        rate = dict(zip(self.paths, map(float, rates)))
        kept: list = []
        taken: set = set()
        while len(kept) < len(self.paths):
            ready = [
                p
                for p in self.paths
                if p not in taken
                and (len(p) == 1 or p[:-1] in taken)
                and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in taken)
            ]
            best = max(ready, key=lambda p: (rate[p], -len(p), [-r for r in p]), default=None)
            if best is None or rate[best] <= 0:  # a node never accepted only costs its verify row
                break
            kept.append(best)
            taken.add(best)
        return kept

    @classmethod
    def of(cls, paths) -> DraftTree:
        """The tree of these rank paths (closed under parents), parents first."""
        return cls(tuple(sorted(paths, key=lambda p: (len(p), p))))

    @cached_property
    def mask(self) -> torch.Tensor:
        """(n+1, n+1) bool over [anchor, nodes]: each row sees the anchor, its ancestors and itself."""
        return tree_mask(self.parents)


def tree_mask(parents) -> torch.Tensor:
    """Parent indices (-1: the anchor; parents first) -> (n+1, n+1) bool over [anchor, nodes]: each row sees the
    anchor, its ancestors and itself."""
    n = len(parents)
    m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    m[:, 0] = True
    for i, par in enumerate(parents):
        m[i + 1, i + 1] = True
        if par >= 0:
            m[i + 1] |= m[par + 1]
    return m


def tree_depths(parents) -> list[int]:
    """Each node's depth below the anchor (1: a child of the anchor)."""
    depth: list[int] = []
    for par in parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


def merge_drafts(tokens: list[int], q: list, parents: list[int], extra, max_nodes: int, max_depth: int):
    """A drafter's tree (node tokens, proposals, parents; [] for none) and a suffix draft (suffix.SuffixDraft) ->
    one tree (tokens, q, parents). A suffix node whose token is already a child of the same parent is that child
    (shared prefixes merged); the others are appended after the drafter's nodes — so a parent's sampled child stays
    its first — as deterministic nodes (q None: certain of their token), while the tree has fewer than `max_nodes`
    nodes and they lie at most `max_depth` below the anchor. Siblings keep distinct tokens, which both tree
    verifiers need."""
    tokens, q, parents = list(tokens), list(q), list(parents)
    depth = tree_depths(parents)
    child = {(par, tok): i for i, (tok, par) in enumerate(zip(tokens, parents))}
    at: dict[int, int] = {}  # suffix node -> merged node
    for i, (tok, par) in enumerate(zip(extra.tokens, extra.parents)):
        if par >= 0 and par not in at:  # its parent did not fit
            continue
        mp = at[par] if par >= 0 else -1
        if (mp, tok) in child:
            at[i] = child[(mp, tok)]
            continue
        d = 1 if mp < 0 else depth[mp] + 1
        if len(tokens) >= max_nodes or d > max_depth:
            continue
        tokens.append(tok)
        q.append(None)
        parents.append(mp)
        depth.append(d)
        at[i] = child[(mp, tok)] = len(tokens) - 1
    return tokens, q, parents


def sample_first_slot(
    logits1: torch.Tensor, cand: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot 1's logits (N, V), candidates cand (N, D, K) -> (q1 (N, V), the sample's index among slot 1's
    candidates (N,)): slot 1 samples from its full warped distribution, and the sample is put among its candidates
    (in place of the K-th when it was not one) so that the walk can continue from it."""
    q1 = warp_probs(logits1, params)
    x1 = sample(q1, generator)
    hit = cand[:, 0] == x1[:, None]
    first_idx = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(x1, cand.shape[-1] - 1))
    cand[:, 0] = cand[:, 0].scatter(1, first_idx[:, None], x1[:, None])
    return q1, first_idx


def propose_tree(
    drafter: DSpineDraftModel,
    out: DraftOutput,
    tree: DraftTree,
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One block (N = 1) -> the tree's node tokens in tree.paths order and each node's proposal q (V,) — None for
    a ranked node (all of them when greedy; the drafter ran at least tree.depth + 1 slots)."""
    cfg = drafter.config
    D = tree.depth
    logits = drafter.logits(out.hidden[:, 0, 1 : D + 1])  # (1, D, V)
    V = logits.shape[-1]
    cand = logits.topk(min(cfg.top_k, V), dim=-1).indices  # (1, D, K)
    sampled = params is not None and not params.greedy
    table = cfg.transition_cache and D > 1
    chain: list[int] = []  # the sampled walk's candidate index (table) or token (no table) per slot
    qs: list[torch.Tensor] = []
    if sampled:
        if table:  # propose()'s walk
            q1, first = sample_first_slot(logits[:, 0], cand, params, generator)
        else:
            qs = list(warp_probs(logits[0], params))
            chain = [int(sample(q, generator)) for q in qs]
    order = None
    if table:
        last = cfg.num_hidden_layers - 1
        inj = drafter.injections[str(last)]
        h_pre, f = out.h_pre[:, 0, : D + 1], out.feats[last][:, 0, : D + 1]
        S = scores_table(inj, drafter.norm, drafter.head, drafter.transfer_codes, h_pre, f, cand, False)
        order = S[0].argsort(-1, descending=True).tolist()  # (D-1, K, K): successors of each candidate, best first
        if sampled:
            rest, q_rest = walk_sample(cand, S, first, params, V, generator)
            chain = [int(first)] + [cand[0, t + 1].tolist().index(x) for t, x in enumerate(rest[0].tolist())]
            qs = [q1[0], *q_rest[0]]
    cand = cand[0].tolist()
    nodes: list[tuple[int, torch.Tensor | None, int]] = []  # (token, q, index among its slot's candidates)
    for path, par in zip(tree.paths, tree.parents):
        t, r = len(path), path[-1]
        ranked = list(range(len(cand[t - 1]))) if order is None or t == 1 else order[t - 2][nodes[par][2]]
        if sampled and not any(path[:-1]):  # the sampled chain's node (r = 0) or a sibling of it
            x = cand[t - 1][chain[t - 1]] if order is not None else chain[t - 1]
            if r == 0:  # without a table the sample may lie outside the candidates (index -1: nothing reads it)
                nodes.append((x, qs[t - 1], chain[t - 1] if order is not None else -1))
                continue
            ranked, r = [j for j in ranked if cand[t - 1][j] != x], r - 1
        nodes.append((cand[t - 1][ranked[r]], None, ranked[r]))
    return [n[0] for n in nodes], [n[1] for n in nodes]


def propose(
    drafter: DSpineDraftModel,
    out: DraftOutput,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    draft_len: int | None = None,
) -> Proposal:
    """One block per row (nb = 1) -> drafts for slots 1..D and, when sampling, their q. D = `draft_len`
    (default B-1): a decode-time choice — the drafter still runs its whole block, but only the first D slots
    are scored, walked and verified (later slots are rarely reached and each costs a target row)."""
    cfg = drafter.config
    D = cfg.block_size - 1 if draft_len is None else draft_len
    h = out.hidden[:, 0, : D + 1]  # (N, D+1, d)
    logits = drafter.logits(h[:, 1:])  # (N, D, V)
    greedy = params.greedy
    if not cfg.transition_cache:
        if greedy:
            return Proposal(logits.argmax(-1), None)
        q = warp_probs(logits, params)
        return Proposal(sample(q, generator), q)

    last = cfg.num_hidden_layers - 1
    state = (
        drafter.injections[str(last)],
        drafter.norm,
        drafter.head,
        drafter.transfer_codes,
        out.h_pre[:, 0, : D + 1],
        out.feats[last][:, 0, : D + 1],
    )
    N, Bm1, V = logits.shape
    K = min(cfg.top_k, V)
    cand = logits.topk(K, dim=-1).indices  # (N, B-1, K)
    if greedy:
        return Proposal(greedy_transition_walk(cand, *state), None)
    fast = kernels.enabled(logits)
    q1, first_idx = sample_first_slot(logits[:, 0], cand, params, generator)
    S = scores_table(*state, cand, fast)
    if fast:  # the kernel samples by inverse CDF from uniforms drawn here, on the request's generator
        from dspine.kernels.transition import fused_walk_sample

        u = torch.rand(N, max(Bm1 - 1, 0), device=cand.device, generator=generator)
        rest, q_rest = fused_walk_sample(cand, S, first_idx, params, V, u)
    else:
        rest, q_rest = walk_sample(cand, S, first_idx, params, V, generator)
    tokens = torch.cat([cand[torch.arange(N), 0, first_idx][:, None], rest], dim=1)
    return Proposal(tokens, torch.cat([q1[:, None], q_rest], dim=1))
