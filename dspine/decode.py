"""The decode loop: every request, alone or batched, decodes through `BatchDecode.step`, one round function.

Per row the state is: committed tokens; the target's KV cache holding every committed position but the last (the
anchor, fed with the next block); the drafter's context K/V for the same positions; with suffix drafting, an index
over the row's prompt and output (suffix.RequestSuffix). A round drafts — a chain of k drafts per row (the
drafter's, or a row's suffix chain in its place), a tree for a single open request (the drafter's static tree with
the suffix draft merged in, decoding.merge_drafts; goodput.TreePolicy says whether the drafter runs and, with
`tree_goodput`, which nodes of each are verified), or nothing (an AR round) —, verifies [anchor, drafts] in one
target forward (a tree under its tree mask), commits the accepted drafts plus the target's own next token, keeps the
committed positions' cache entries and appends their target features to the drafter's context (lazily when the
drafter did not run). Every committed token passes through one stop checker (EOS, max tokens, stop strings), so
speculative and AR outputs end exactly alike.

The context window is decided once: a row whose next token would sit past the target's window ends with
"length"; a round whose drafter slots would reach past it for any open row is an AR round — every request runs
to the window's last position, whichever entry point decodes it (`Engine.generate` is a one-row batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dspine.decoding import DraftTree, Proposal, merge_drafts, propose, propose_tree, tree_depths, tree_mask
from dspine.drafter import block_attention_mask
from dspine.sampling import RequestError, SamplingParams, penalize, warp_probs
from dspine.state import (
    DraftContext,
    GenerationResult,
    PhaseClock,
    Stopper,
    logprob_of,
    new_generator,
    pad_columns,
    prefill,
    stack_caches,
)
from dspine.stats import AcceptanceStats
from dspine.suffix import RequestSuffix
from dspine.verify import verify_chain, verify_forced, verify_tree_greedy, verify_tree_sampled

if TYPE_CHECKING:
    from dspine.engine import Engine


@dataclass
class _Plan:
    """What a round drafts: "ar" (nothing), "chain" (k drafts per row, `suffix[i]` replacing row i's drafter chain
    where given), or "tree" (a single row: the drafter's `tree` when `drafter` runs, merged with the suffix draft)."""

    mode: str
    k: int = 0
    tree: DraftTree | None = None
    drafter: bool = False
    suffix: list = field(default_factory=list)  # per row: a SuffixDraft, or None
    room: int = 0  # how deep a tree round's nodes may lie (the window)
    expect: float = 0.0  # a tree round's expected accepted drafts (goodput.TreePolicy)


@dataclass
class _Round:
    """What a round feeds the target: tokens (N, n), positions (N, n), the attention mask (None: causal over the
    whole cache) and the drafts — a chain's Proposal, or a tree's node tokens, proposals and parents."""

    feed: torch.Tensor
    pos: torch.Tensor
    att: torch.Tensor | None
    prop: Proposal | None = None  # a chain round's drafts
    nodes: list[int] | None = None  # a tree round's node tokens
    q: list | None = None  # their proposals (None: deterministic)
    parents: list[int] | None = None
    static: int = 0  # how many of the nodes are the drafter's (its subtree `tree` of the engine's round tree)
    drafted: bool = False  # the drafter ran this round
    tree: DraftTree | None = None
    expect: float = 0.0


class BatchDecode:
    """A batch of requests decoded round by round: `step()` runs one round for every row, so a scheduler can
    interleave several batches and move rows in and out between rounds.

    Rows advance by different amounts: each row's target KV cache and drafter context keep the positions fed
    up to the longest acceptance of the round (the rest is cropped), and one validity mask (N, columns) hides
    what a row did not commit (prompt padding, rejected drafts, another row's columns); positions are passed
    explicitly (committed tokens so far). A batch of one row thus keeps only what it committed (`dense`: no
    mask is needed). Keys carry their positions (RoPE), so a row's columns may sit anywhere: that is what
    lets rows leave (`pop_finished`: finished rows' results out, their state dropped), join (`merge`: another
    batch, prefilled apart, padded to the wider of the two with masked columns) and be squeezed (`compact`:
    every row's committed columns moved to the front, the columns no row needs cut).

    `params` is one SamplingParams or one per row: rows may differ in max_tokens, stop, ignore_eos, penalties
    and logprobs, not in how tokens are drawn (temperature, top-k, top-p; one generator, seeded from the first
    row). Penalties apply to the target's logits at every verify position as AR would have applied them after
    the drafts before it (sampling.penalize), so decoding stays AR's. Logprobs are the target's raw
    distribution (before temperature, top-k/p and penalties). `on_tokens[i]` sees row i's tokens as they are
    committed (False aborts that row); `tags[i]` names row i in what pop_finished returns (default: i).
    `forced[i]` (a list of token ids, or None) makes row i a replay of that text: another engine's greedy
    output stands in for the target's choices — drafts are accepted while they match it and its next token is
    committed — so a drafter's τ is measured on exactly that text (greedy only; ends where the text ends).
    `profile`: each result's `timings` holds the batch's seconds per phase (PhaseClock), the device synchronised
    at each boundary — slower, for benchmarks only. `workloads[i]`: whose part of the engine's suffix corpus drafts
    for row i (default "default")."""

    _ROW_LISTS = (
        "lens",
        "cached",
        "tags",
        "peak",
        "t0",
        "stats",
        "stops",
        "anchors",
        "finished",
        "forced",
        "accept",
        "suffix",
    )

    @torch.no_grad()
    def __init__(
        self,
        engine: Engine,
        prompts: list,
        params=None,
        on_tokens: list | None = None,
        tags=None,
        forced=None,
        profile: bool = False,
        workloads: list[str] | None = None,
    ):
        per_row = params if isinstance(params, list) else [params] * len(prompts)
        rows = [(p or SamplingParams()).validate() for p in per_row]
        self.forced = list(forced) if forced is not None else [None] * len(prompts)
        for i, f in enumerate(self.forced):
            if f is not None:
                if not rows[i].greedy or not f:
                    raise RequestError("a forced continuation needs greedy decoding and at least one token")
                rows[i] = SamplingParams(max_tokens=len(f), temperature=0.0, ignore_eos=rows[i].ignore_eos)
        self.params = params = rows[0]
        if any(self._draw(r) != self._draw(params) for r in rows):
            raise ValueError("rows of one batch must share temperature, top_k and top_p")
        self.engine, self.drafter = engine, engine.drafter
        tgt, dev, drafter = engine.target, engine.target.device, engine.drafter
        ids = [engine.prompt_ids(p) for p in prompts]
        N, self.lens = len(ids), [len(x) for x in ids]
        self.clock = PhaseClock(dev, profile)
        self.tags = list(tags) if tags is not None else list(range(N))
        self.peak = [N] * N
        self.gen = new_generator(dev, params.seed)
        self.t0 = [time.perf_counter()] * N
        self.layer_ids = drafter.config.target_layer_ids if drafter is not None else None
        self.B = drafter.config.block_size if drafter is not None else 1
        hist = max(self.B, engine.suffix.max_depth + 1 if engine.suffix is not None else 0)  # accepted drafts + 1
        self.stats = [AcceptanceStats(hist) if engine.speculative else None for _ in range(N)]
        workloads = workloads or ["default"] * N
        self.suffix = [
            RequestSuffix(x, engine.suffix, engine.corpus, w) if engine.suffix is not None else None
            for x, w in zip(ids, workloads)
        ]
        self.accept = [engine.policy.new_row() if engine.policy is not None else None for _ in range(N)]
        self.stops = [Stopper(tgt, r, cb) for r, cb in zip(rows, on_tokens or [None] * N)]
        V = tgt.info.vocab_size
        self.counts = torch.zeros(N, V, device=dev) if any(r.penalized for r in rows) else None  # output tokens
        self.cache, self.valid, last, feats, self.cached = prefill(tgt, ids, self.layer_ids, engine.prefix_cache)
        self.dense = N == 1  # every cache column committed: rounds need no mask
        pos = torch.arange(self.width, device=dev).expand(N, -1)
        self.committed = torch.tensor(self.lens, device=dev)  # tokens each row has in its cache = the anchor's position
        self.anchors = [
            engine.pick(last[i], params, self.gen) if f is None else int(f[0]) for i, f in enumerate(self.forced)
        ]
        self.finished = [self._push(i, a, last[i]) for i, a in enumerate(self.anchors)]
        self.ctx = None
        if drafter is not None:
            self.ctx = DraftContext(drafter)
            self.ctx.extend(feats, pos)
        self.clock.lap("prefill")

    @staticmethod
    def _draw(p: SamplingParams):
        return p.temperature, p.top_k, p.top_p

    def __len__(self) -> int:
        return len(self.tags)

    @property
    def done(self) -> bool:
        return all(self.finished)

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def _push(self, i: int, tok: int, raw: torch.Tensor) -> bool:
        """Commit `tok` to row i; raw (V,): the target's logits it was chosen from."""
        stop = self.stops[i]
        if self.suffix[i] is not None:
            self.suffix[i].push([tok])
        lp = logprob_of(raw, tok, stop.params.logprobs) if stop.params.logprobs is not None else None
        if self.counts is not None:
            self.counts[i, tok] += 1
        return stop.push(tok, lp)

    # ---- the round -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """One round for every open row (a no-op once all rows are done): plan, draft, verify, commit."""
        if self.done:
            return
        self._end_at_window()
        if self.done:
            return
        plan = self._plan()
        t_round = time.perf_counter()
        rnd = self._draft(plan)
        drafting = plan.mode != "ar"
        layer_ids = self.layer_ids if self.drafter is not None else None
        logits, feats = self.engine.target.forward(rnd.feed, self.cache, layer_ids, rnd.att, rnd.pos)
        if drafting:
            self.clock.lap("verify")
        if plan.mode == "tree":
            self._commit_tree(rnd, logits, feats, time.perf_counter() - t_round)
        else:
            self._commit_chain(rnd, logits, feats, plan.k, time.perf_counter() - t_round)
        self.clock.lap("commit" if drafting else "ar_step")  # acceptance test, cache, drafter context, stop checks

    def _end_at_window(self) -> None:
        """Rows whose next token would sit past the target's window end with "length"."""
        edge = (self.committed + 1 >= self.engine.max_positions).tolist()
        for i, e in enumerate(edge):
            if e and not self.finished[i]:
                self.stops[i].finish_reason, self.finished[i] = "length", True

    def _plan(self) -> _Plan:
        """This round's drafts. A single open request that may use a tree (no penalties, not forced) gets a tree
        round when the engine has a tree or suffix drafting; otherwise a chain of k drafts per row, k = 0 (an AR
        round) without a drafter or suffix, for a batch over `spec_max_batch`, by the goodput policy's choice, or
        where drafter slots would reach past the window for some open row."""
        engine, drafter = self.engine, self.drafter
        if not engine.speculative:
            return _Plan("ar")
        open_rows = [i for i, f in enumerate(self.finished) if not f]
        if engine.spec_max_batch is not None and len(open_rows) > engine.spec_max_batch:
            return _Plan("ar")
        top = int(self.committed[open_rows].max())
        room = engine.max_positions - 1 - top  # the deepest draft position that fits the window
        single = len(self) == 1 and self.counts is None and self.forced[0] is None
        if single and (engine.tree is not None or engine.suffix is not None):
            sd = self.suffix[0].draft() if engine.suffix is not None else None
            can = engine.round_tree is not None and engine.round_tree.depth <= room  # the drafter's slots fit
            tree, expect = (engine.round_tree if can else None), 0.0
            if engine.tree_policy is not None:  # with suffix drafts: which nodes, and whether the drafter runs
                tree, sd, expect = engine.tree_policy.plan(sd, can)
            if tree is None and not sd:
                return _Plan("ar")
            if tree is not None:
                self.ctx.project()  # columns waiting from earlier rounds: their cost is not this round's
            return _Plan("tree", tree=tree, drafter=tree is not None, suffix=[sd], room=room, expect=expect)
        k, suffix = 0, [None] * len(self)
        if engine.suffix is not None:
            suffix = [self.suffix[i].draft() if not self.finished[i] else None for i in range(len(self))]
        if drafter is not None:
            k = engine.draft_len
            if engine.policy is not None:
                k = engine.policy.choose([self.accept[i] for i in open_rows], len(self))
            slots = engine.draft_block - engine.draft_len + k
            if k and top + slots > engine.max_positions:
                k = 0
            if k:
                self.ctx.project()
                # a row takes the suffix's chain where it reaches k drafts and expects more than one accepted
                fits = [bool(sd) and len(sd.best_path()) >= k and sd.expected_tokens() > 1 for sd in suffix]
                suffix = [sd if ok else None for sd, ok in zip(suffix, fits)]
            return _Plan("chain" if k else "ar", k=k, drafter=k > 0, suffix=suffix if k else [])
        if engine.suffix is not None:  # suffix alone: one chain length, shorter drafts padded (SuffixChainPolicy)
            k = engine.suffix_policy.choose([suffix[i] for i in open_rows], len(self), min(engine.draft_len, room))
        return _Plan("chain" if k else "ar", k=k, suffix=suffix if k else [])

    def _draft(self, plan: _Plan) -> _Round:
        """The drafter's forward and proposal, the suffix drafts merged in (none for an AR round) -> what the
        target verifies."""
        drafter, dev, N = self.drafter, self.valid.device, len(self)
        anchor = torch.tensor(self.anchors, device=dev)[:, None]
        ones = lambda n: self.valid.new_ones(N, n)
        if plan.mode == "ar":
            att = None if self.dense else torch.cat([self.valid, ones(1)], 1).long()
            return _Round(anchor, self.committed[:, None], att)
        out = None
        if plan.drafter:
            engine = self.engine
            slots = plan.tree.depth + 1 if plan.mode == "tree" else engine.draft_block - engine.draft_len + plan.k
            pos = self.committed[:, None] + torch.arange(slots, device=dev)  # (N, slots)
            mask = None if self.dense else block_attention_mask(self.valid[:, None], slots, drafter.config.is_causal)
            out = drafter(drafter.block_inputs(anchor, slots), pos[:, None], self.ctx.kv, mask)
            self.clock.lap("draft")
        rnd = self._tree_round(plan, out) if plan.mode == "tree" else self._chain_round(plan, out, anchor)
        self.clock.lap("propose")
        return rnd

    def _tree_round(self, plan: _Plan, out) -> _Round:
        """A single row's tree: the drafter's static tree (when it ran) with the suffix draft merged in."""
        dev = self.valid.device
        nodes, q, parents = [], [], []
        if plan.drafter:
            nodes, q = propose_tree(self.drafter, out, plan.tree, self.params, self.gen)
            parents = list(plan.tree.parents)
        static, sd = len(nodes), plan.suffix[0]
        if sd:
            cap = self.engine.suffix.max_nodes
            nodes, q, parents = merge_drafts(nodes, q, parents, sd, static + cap, plan.room)
        n, W = len(nodes), self.width
        att = torch.ones(1, 1, n + 1, W + n + 1, dtype=torch.bool, device=dev)
        att[0, 0, :, :W] = self.valid[0]
        att[0, 0, :, W:] = tree_mask(parents).to(dev)
        depths = torch.tensor([0, *tree_depths(parents)], device=dev)
        feed = torch.tensor([[self.anchors[0], *nodes]], device=dev)
        return _Round(feed, self.committed[:, None] + depths[None], att, nodes=nodes, q=q, parents=parents,
                      static=static, drafted=plan.drafter, tree=plan.tree, expect=plan.expect)  # fmt: skip

    def _chain_round(self, plan: _Plan, out, anchor: torch.Tensor) -> _Round:
        """k drafts per row: the drafter's chain, or a row's suffix chain in its place (q certain of its tokens)."""
        dev, N, k = self.valid.device, len(self), plan.k
        prop = propose(self.drafter, out, self.params, self.gen, k) if plan.drafter else None
        picks = {i: sd for i, sd in enumerate(plan.suffix) if sd is not None and not self.finished[i]}
        if picks or prop is None:
            tokens = prop.tokens.clone() if prop is not None else torch.zeros(N, k, dtype=torch.long, device=dev)
            if prop is None:  # suffix alone: every row's best path, a shorter one (or none) padded (SuffixChainPolicy)
                picks = {i: sd for i, sd in enumerate(plan.suffix)}
            for i, sd in picks.items():
                path = [sd.tokens[j] for j in sd.best_path()[:k]] if sd else []
                tokens[i] = torch.tensor((path + [path[-1] if path else self.anchors[i]] * k)[:k], device=dev)
            q = None
            if not self.params.greedy:
                V = self.engine.target.info.vocab_size
                q = prop.q.clone() if prop is not None else torch.zeros(N, k, V, device=dev)
                for i in picks:  # certain proposals, pads included
                    q[i] = torch.nn.functional.one_hot(tokens[i], V).to(q.dtype)
            prop = Proposal(tokens, q)
        att = None if self.dense else torch.cat([self.valid, self.valid.new_ones(N, k + 1)], 1).long()
        pos = self.committed[:, None] + torch.arange(k + 1, device=dev)
        return _Round(torch.cat([anchor, prop.tokens], 1), pos, att, prop=prop, drafted=plan.drafter)

    def _commit_tree(self, rnd: _Round, logits: torch.Tensor, feats, seconds: float) -> None:
        """A single row's tree round: the accepted path's cache entries kept behind the committed columns (the
        rest dropped, in the cache and in the drafter's context), its tokens committed; the drafter's nodes'
        acceptance and the round's cost recorded."""
        engine, nodes, tgt = self.engine, rnd.nodes, self.engine.target
        if self.params.greedy:
            path, nxt = verify_tree_greedy(nodes, rnd.parents, logits[0])
        else:
            path, nxt = verify_tree_sampled(nodes, rnd.q, rnd.parents, warp_probs(logits[0], self.params), self.gen)
        kept = [0] + [i + 1 for i in path]
        tgt.keep_cache(self.cache, self.width, kept)
        if self.ctx is not None:  # lazy when the drafter did not run: projected when it next does
            self.ctx.extend(feats[:, kept], rnd.pos[:, kept], lazy=not rnd.drafted)
        toks = [nodes[i] for i in path] + [nxt]
        if rnd.drafted:  # the drafter's nodes: by their index in the engine's tree (all of it, or a subtree)
            mine = [i for i in path if i < rnd.static]
            if rnd.tree is engine.round_tree:
                engine.tree_profile.record(mine)
            else:
                offered = [engine.round_index[p] for p in rnd.tree.paths]
                engine.tree_profile.record([offered[i] for i in mine], offered)
        if engine.tree_policy is not None:
            shape = (len(nodes) + 1, rnd.drafted)
            engine.tree_policy.record(rnd.drafted, rnd.expect, len(path), len(nodes) + 1, seconds, shape)
        self.valid = torch.cat([self.valid, self.valid.new_ones(1, len(toks))], 1)
        self.committed = self.committed + len(toks)
        self.stats[0].record(len(path))
        raw = logits[0, kept]
        self.finished[0] = any(self._push(0, tok, raw[j]) for j, tok in enumerate(toks))
        self.anchors[0] = toks[-1]

    def _commit_chain(self, rnd: _Round, logits: torch.Tensor, feats, k: int, seconds: float) -> None:
        """A chain (or AR) round for every row: each row's accepted prefix kept, masked per row; columns no row
        accepted are cropped away."""
        engine, tgt, prop, dev, N = self.engine, self.engine.target, rnd.prop, self.valid.device, len(self)
        chosen = self._penalized(logits, prop)  # what tokens are chosen from
        if prop is not None:
            n_acc, nxt = verify_chain(prop, chosen, self.params, self.gen)
        else:
            n_acc = torch.zeros(N, dtype=torch.long, device=dev)
            nxt = torch.tensor([engine.pick(chosen[i, -1], self.params, self.gen) for i in range(N)], device=dev)
        if any(f is not None for f in self.forced):
            n_acc, nxt = self._forced_verdicts(n_acc, nxt, prop)
        m = int(n_acc.max()) + 1
        tgt.crop_cache(self.cache, self.width + m)
        kept = torch.arange(m, device=dev)[None] <= n_acc[:, None]  # (N, m); all True in a dense batch
        self.valid = torch.cat([self.valid, kept], 1)
        if self.ctx is not None:  # an AR round's token too (projected when drafting resumes)
            self.ctx.extend(feats[:, :m], rnd.pos[:, :m], lazy=not rnd.drafted)
        self.committed = self.committed + n_acc + 1
        if engine.policy is not None:
            self._observe(k if rnd.drafted else 0, n_acc, rnd.feed.shape[1], seconds)
        if engine.suffix_policy is not None:
            engine.suffix_policy.observe(len(self) * rnd.feed.shape[1], k > 0, seconds, (len(self), k))
        self._commit(n_acc, nxt, prop, logits)
        if not self.dense:
            self.compact()  # rows that accepted less than the round's longest leave masked holes

    def _observe(self, k: int, n_acc: torch.Tensor, width: int, seconds: float) -> None:
        """The policy learns the round: each open row's acceptance of its k drafts, the round's cost."""
        policy = self.engine.policy
        if k:
            for i in [i for i, f in enumerate(self.finished) if not f]:
                policy.record(self.accept[i], k, int(n_acc[i]))
        policy.observe(len(self) * width, k > 0, seconds, (len(self), k))

    def _forced_verdicts(self, n_acc: torch.Tensor, nxt: torch.Tensor, prop):
        """The forced rows' (accepted, next) replaced by the match of their drafts against their given text."""
        n_list, nxt_list = n_acc.tolist(), nxt.tolist()
        for i, f in enumerate(self.forced):
            if f is None or self.finished[i]:
                continue
            ahead = f[len(self.stops[i].tokens) :]  # the text after the anchor
            if prop is None:
                n_list[i], nxt_list[i] = 0, ahead[0] if ahead else nxt_list[i]
            else:
                n, t = verify_forced(prop.tokens[i : i + 1], ahead)
                n_list[i], nxt_list[i] = int(n[0]), int(t[0])
        return n_acc.new_tensor(n_list), nxt.new_tensor(nxt_list)

    def _penalized(self, logits: torch.Tensor, prop) -> torch.Tensor:
        """logits (N, W, V) -> a copy penalized for the rows that ask for it (the same tensor when none do)."""
        if self.counts is None:
            return logits
        chosen = logits.clone()
        for i, stop in enumerate(self.stops):
            if stop.params.penalized and not self.finished[i]:
                drafts = prop.tokens[i] if prop is not None else self.committed.new_empty(0)
                chosen[i] = penalize(logits[i], self.counts[i], drafts, stop.params)
        return chosen

    def _commit(self, n_acc: torch.Tensor, nxt: torch.Tensor, prop, logits: torch.Tensor) -> None:
        """Each open row's accepted drafts and next token through its stopper (logits (N, W, V): raw)."""
        for i in range(len(self)):
            if self.finished[i]:
                continue
            n = int(n_acc[i])
            if self.stats[i] is not None and prop is not None:  # rounds that drafted
                self.stats[i].record(n)
            for j, tok in enumerate((prop.tokens[i, :n].tolist() if prop is not None else []) + [int(nxt[i])]):
                if self._push(i, tok, logits[i, j]):
                    self.finished[i] = True
                    break
            self.anchors[i] = int(nxt[i])

    # ---- rows in and out ---------------------------------------------------------------------------------
    def _map_rows(self, fn) -> None:
        """Apply fn to every per-row tensor of the state: target cache and drafter context (N, H, C, hd)."""
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)
        if self.ctx is not None:
            self.ctx.kv = [(fn(k), fn(v)) for k, v in self.ctx.kv]

    def pop_finished(self) -> list[tuple]:
        """-> [(tag, GenerationResult)] of the rows that have finished; their state leaves the batch."""
        done = [i for i, f in enumerate(self.finished) if f]
        if not done:
            return []
        out = [(self.tags[i], self._result(i)) for i in done]
        keep = [i for i, f in enumerate(self.finished) if not f]
        idx = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        for name in self._ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        self.valid, self.committed = self.valid[idx], self.committed[idx]
        if self.counts is not None:
            self.counts = self.counts[idx]
        self._map_rows(lambda t: t[idx])
        if keep:
            self.compact()
        self.dense = len(keep) == 1 and bool(self.valid.all())
        return out

    def compact(self, slack: float = 1.25) -> None:
        """Move every row's committed columns to the front and cut the rest, once the cache is wider than
        `slack` × its fullest row (+ 16)."""
        need = int(self.valid.sum(1).max())
        if self.width <= slack * need + 16:
            return
        order = (~self.valid).to(torch.int8).argsort(dim=1, stable=True)[:, :need]  # (N, need): valid first
        self.valid = self.valid.gather(1, order)
        self._map_rows(lambda t: t.gather(2, order[:, None, :, None].expand(t.shape[0], t.shape[1], need, t.shape[3])))

    def can_merge(self, other: BatchDecode) -> bool:
        return other.engine is self.engine and self._draw(other.params) == self._draw(self.params)

    def merge(self, other: BatchDecode) -> None:
        """Take other's rows into this batch (same engine, same way of drawing tokens; other is consumed). The
        narrower cache is padded with masked columns; this batch's generator keeps drawing for all rows."""
        if not self.can_merge(other):
            raise ValueError("only batches of one engine that draw tokens alike can merge")
        C = max(self.width, other.width)
        for b in (self, other):
            b.valid = torch.cat([b.valid, b.valid.new_zeros(len(b), C - b.width)], 1)
        self.cache = stack_caches([self.cache, other.cache], C)
        if self.ctx is not None:
            pair = lambda a, b: torch.cat([pad_columns(a, C), pad_columns(b, C)])
            self.ctx.kv = [(pair(k0, k1), pair(v0, v1)) for (k0, v0), (k1, v1) in zip(self.ctx.kv, other.ctx.kv)]
        if self.counts is not None or other.counts is not None:
            V = self.engine.target.info.vocab_size
            z = lambda b: b.counts if b.counts is not None else torch.zeros(len(b), V, device=b.valid.device)
            self.counts = torch.cat([z(self), z(other)])
        self.valid, self.committed = torch.cat([self.valid, other.valid]), torch.cat([self.committed, other.committed])
        for name in self._ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak = [max(p, len(self)) for p in self.peak]
        self.dense = False

    def _result(self, i: int) -> GenerationResult:
        s = self.stops[i]
        return GenerationResult(
            token_ids=s.tokens,
            text=s.result_text(),
            finish_reason=s.finish_reason or "length",
            prompt_tokens=self.lens[i],
            cached_tokens=self.cached[i],
            method=self.engine.method,
            stats=self.stats[i],
            seconds=time.perf_counter() - self.t0[i],
            timings=dict(self.clock.totals),
            batch_size=self.peak[i],
            logprobs=s.logprobs,
        )
