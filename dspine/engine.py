"""The embedded engine: autoregressive and speculative decoding over a KV-cached target.

Per request the state is: committed tokens; the target's KV cache holding every committed position but the
last (the anchor, fed with the next block); the drafter's context K/V for the same positions. A speculative
round drafts B-1 tokens from [anchor, mask...], verifies [anchor, drafts] in one causal target forward,
commits the accepted drafts plus the target's own next token, crops the target cache back to the committed
positions and appends their target features to the drafter's context. AR decoding is the same loop with
no drafts. Every committed token passes through one stop checker (EOS, max tokens, stop strings), so
speculative and AR outputs end exactly alike. With a draft tree (decoding.DraftTree), a single request's round
verifies the tree's nodes in one forward under a tree mask and keeps only the accepted path's entries (when
sampling, the tree hangs ranked siblings on the sampled chain: verify.verify_tree_sampled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspine.decoding import DraftTree, propose, propose_tree
from dspine.drafter import DraftOutput, DSpineDraftModel, block_attention_mask
from dspine.goodput import DraftPolicy
from dspine.sampling import RequestError, SamplingParams, penalize, sample, warp_probs
from dspine.stats import AcceptanceStats
from dspine.target import Target
from dspine.verify import verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    method: str
    stats: AcceptanceStats | None = None
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)
    batch_size: int = 1  # the most rows decoded together with this one (BatchDecode)
    # with params.logprobs: per token, (its log-probability, [(token id, log-probability)] of the top k)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def verify(prop, logits: torch.Tensor, params: SamplingParams, gen, sampled_verifier=verify_sampled):
    """Proposal + target logits (N, B, V) at [anchor, drafts] -> (accepted (N,), next token (N,))."""
    if params.greedy:
        return verify_greedy(prop.tokens, logits)
    return sampled_verifier(prop.tokens, prop.q, warp_probs(logits, params), gen)


def verify_forced(drafts: torch.Tensor, ahead: list[int]):
    """drafts (1, B-1) against the given continuation -> (accepted (1,), next token (1,)); past the end of
    `ahead` nothing is accepted and the next token is a placeholder the stopper never reaches."""
    n = 0
    row = drafts[0].tolist()
    while n < len(row) and n < len(ahead) and row[n] == ahead[n]:
        n += 1
    nxt = ahead[n] if n < len(ahead) else row[0]
    return torch.tensor([n]), torch.tensor([nxt])


class _Stopper:
    """Appends tokens one at a time and decides when generation ends, identically for every method."""

    def __init__(self, target: Target, params: SamplingParams, on_token=None):
        self.target, self.params, self.on_token = target, params, on_token
        self.eos = set() if params.ignore_eos else target.eos_token_ids
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.logprobs: list | None = [] if params.logprobs is not None else None

    def push(self, tok: int, logprob=None) -> bool:
        if tok in self.eos:
            self.finish_reason = "stop"
            return True
        self.tokens.append(tok)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.params.stop:
            text = self.target.decode(self.tokens)
            hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
            if hits:
                self.text, self.finish_reason = text[: min(hits)], "stop"
                return True
        # after the stop-string check, so a stream never shows the stop string
        if self.on_token is not None and self.on_token(tok) is False:  # the client went away
            self.finish_reason = "abort"
            return True
        if len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def result_text(self) -> str:
        return self.text if self.text is not None else self.target.decode(self.tokens)


class _PhaseClock:
    """Seconds per phase of a generation, the device synchronised at each boundary (off: no cost)."""

    def __init__(self, device: torch.device, on: bool):
        self.on, self.cuda = on, device.type == "cuda"
        self.totals: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if not self.on:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self._t
        self._t = now


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def _tree_round(
    tgt: Target, drafter, tree: DraftTree, out, anchor: int, P: int, cache, ctx, visible, clock, params, gen
):
    """A round through a draft tree after the drafter's forward: the nodes verified in one target forward under
    the tree mask beside the cache's `visible` (1, W) columns, the accepted path's entries kept behind them (the
    rest dropped, in the cache and in the drafter's context) -> (the accepted drafts and the target's next token,
    the target's raw logits each was chosen from (len, V), the accepted nodes' indices)."""
    dev = tgt.device
    toks, q = propose_tree(drafter, out, tree, params, gen)
    clock.lap("propose")
    n, W = len(toks), visible.shape[1]
    att = torch.ones(1, 1, n + 1, W + n + 1, dtype=torch.bool, device=dev)
    att[0, 0, :, :W] = visible[0]
    att[0, 0, :, W:] = tree.mask.to(dev)
    pos = (P + tree.depths.to(dev))[None]  # (1, n+1)
    feed = torch.tensor([[anchor] + toks], device=dev)
    logits, feats = tgt.forward(feed, cache, drafter.config.target_layer_ids, att, pos)
    clock.lap("verify")
    if params.greedy:
        path, nxt = verify_tree_greedy(toks, tree.parents, logits[0])
    else:
        path, nxt = verify_tree_sampled(toks, q, tree.parents, warp_probs(logits[0], params), gen)
    rows = [0] + [i + 1 for i in path]
    tgt.keep_cache(cache, W, rows)
    ctx.extend(feats[:, rows], pos[:, rows])
    return [toks[i] for i in path] + [nxt], logits[0, rows], path


class TreeProfile:
    """How often each node of the engine's draft tree was accepted, over its tree rounds (`DraftTree.prune`
    turns the rates into a smaller tree)."""

    def __init__(self, nodes: int):
        self.accepted, self.rounds = [0] * nodes, 0

    def record(self, path: list[int]) -> None:
        self.rounds += 1
        for i in path:
            self.accepted[i] += 1

    @property
    def rates(self) -> list[float]:
        return [a / max(self.rounds, 1) for a in self.accepted]


class DraftContext:
    """The drafter's per-layer context K/V for committed positions (grows; block K/V are never kept). Features
    extended `lazy` (rounds that do not draft) wait, and are projected in one call when `kv` is next read — by
    the drafter, or to move the columns — so a batch that decodes AR for a while pays nothing per round."""

    def __init__(self, drafter: DSpineDraftModel):
        self.drafter = drafter
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._waiting: list[tuple[torch.Tensor, torch.Tensor]] = []

    def extend(self, feats: torch.Tensor, pos: torch.Tensor, lazy: bool = False) -> None:
        """feats (N, n, m*d), pos (N, n)."""
        self._waiting.append((feats, pos))
        if not lazy:
            self.project()

    def project(self) -> None:
        """Project the waiting columns now."""
        if not self._waiting:
            return
        feats, pos = (torch.cat(x, 1) for x in zip(*self._waiting))
        self._waiting = []
        new = self.drafter.context_kv(feats, pos)
        if self._kv is None:
            self._kv = new
        else:
            self._kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self._kv, new)]

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (k, v) each (N, Hkv, C, hd), every extended column included."""
        self.project()
        return self._kv

    @kv.setter
    def kv(self, value: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._waiting:
            raise RuntimeError("the context's waiting columns must be projected before its K/V are replaced")
        self._kv = value


class Engine:
    """Generate with a target alone (`method="ar"`) or with a DSpine/DFlash/post-backbone drafter."""

    def __init__(
        self,
        target: Target,
        drafter: DSpineDraftModel | None = None,
        draft_len: int | None = None,
        draft_block: int | None = None,
        spec_max_batch: int | None = None,
        tree: DraftTree | str | None = None,
        goodput: bool = False,
    ):
        """`draft_len`: drafts verified per round (1 .. block_size-1; default block_size-1), a decode-time
        choice: each draft costs a row of the target's verify forward. `draft_block`: block slots the drafter
        runs per round (draft_len+1 .. block_size; default block_size) — slots past the drafts are never
        verified, but in a bidirectional block the earlier slots attend to them. `spec_max_batch`: the most
        open rows a batched round drafts for (default: no limit); a fuller batch decodes its round
        autoregressively, where verifying drafts costs more than it returns (vLLM's
        `disable_by_batch_size`). The drafter's context follows those rounds too, so drafting resumes as soon
        as the batch is small again. `tree` (a DraftTree or its spec, decoding.py): rounds of a single open
        request verify that tree of drafts instead of a chain, the drafter running depth + 1 slots (draft_len
        then defaults to the depth); rounds of several requests, penalties and forced replays keep the chain.
        `goodput`: each batched round drafts 0 .. draft_len tokens, as many as maximise the tokens expected per
        second of the round (goodput.DraftPolicy: the rows' acceptance so far against the measured cost of
        verifying more rows) — on a CPU, where every verified row costs compute, a full batch drafts less."""
        self.target = target
        self.drafter = drafter.bind(target) if drafter is not None else None
        self.method = drafter.config.method if drafter is not None else "ar"
        B = drafter.config.block_size if drafter is not None else 1
        self.tree = None
        if tree is not None:
            self.tree = DraftTree.for_drafter(tree, drafter.config if drafter is not None else None)
            draft_len = draft_len or self.tree.depth
        self.tree_profile = TreeProfile(len(self.tree.paths) if self.tree is not None else 0)
        if draft_len is not None and not 1 <= draft_len <= B - 1:
            raise ValueError(f"draft_len must be in [1, {B - 1}] for this drafter (block size {B}), got {draft_len}")
        self.draft_len = draft_len or max(B - 1, 0)
        if draft_block is not None and not self.draft_len + 1 <= draft_block <= B:
            raise ValueError(f"draft_block must be in [{self.draft_len + 1}, {B}] (draft_len + 1 .. block size)")
        self.draft_block = draft_block or B
        if spec_max_batch is not None and spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1 (the most open rows a round drafts for): {spec_max_batch}")
        self.spec_max_batch = spec_max_batch
        self.policy = DraftPolicy(self.draft_len) if goodput and drafter is not None else None
        self.max_positions = target.info.max_position_embeddings

    # ---- inputs ----------------------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RequestError("prompt is empty")
            ids = self.target.chat_ids([{"role": "user", "content": prompt}])
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if not any(str(m.get("content", "")).strip() for m in prompt):
                raise RequestError("messages have no content")
            ids = self.target.chat_ids(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = [int(t) for t in prompt]
        else:
            raise RequestError(f"prompt must be text, chat messages or token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.target.info.vocab_size]
        if bad:
            raise RequestError(f"prompt has token ids outside the vocabulary: {bad[:5]}")
        if len(ids) >= self.max_positions:
            raise RequestError(f"prompt has {len(ids)} tokens; the target's context is {self.max_positions}")
        return ids

    # ---- decoding --------------------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen) -> int:
        """logits (V,) -> next token, exactly as AR decoding picks it."""
        if params.greedy:
            return int(logits.argmax())
        return int(sample(warp_probs(logits, params), gen))

    @torch.no_grad()
    def generate(
        self,
        prompt,
        params: SamplingParams | None = None,
        on_token=None,
        profile: bool = False,
        forced: list[int] | None = None,
    ) -> GenerationResult:
        """`on_token(token_id)` sees every committed token as it is committed; returning False aborts.
        `profile` fills `timings` (seconds per phase: prefill, draft, propose, verify, commit, ar_step), with
        a device sync at each boundary — slower, for benchmarks only.
        `forced`: a given continuation (another engine's greedy output, e.g. SGLang's) stands in for the
        target's choices — drafts are accepted while they match it and its next token is committed — so the
        drafter's τ is measured on exactly that text (greedy only; ends where it ends)."""
        params = (params or SamplingParams()).validate()
        if params.penalized or params.logprobs is not None:
            raise RequestError("penalties and logprobs are decoded by BatchDecode (generate_batch, dspine serve)")
        if forced is not None:
            if not params.greedy or not forced:
                raise RequestError("a forced continuation needs greedy decoding and at least one token")
            params = SamplingParams(max_tokens=len(forced), temperature=0.0, ignore_eos=params.ignore_eos)
        clock = _PhaseClock(self.target.device, profile)
        ids = self.prompt_ids(prompt)
        gen = _generator(self.target.device, params.seed)
        t0 = time.perf_counter()
        tgt, dev = self.target, self.target.device
        spec = self.drafter is not None
        layer_ids = self.drafter.config.target_layer_ids if spec else None
        B = self.drafter.config.block_size if spec else 1
        stats = AcceptanceStats(B) if spec else None
        stop = _Stopper(tgt, params, on_token)
        tree = self.tree if forced is None else None

        cache = tgt.new_cache()
        last = torch.tensor([len(ids) - 1], device=dev)
        logits, feats = tgt.forward(torch.tensor([ids], device=dev), cache, layer_ids, logits_at=last)
        P = len(ids)  # the target cache holds positions [0, P); the anchor sits at P
        ctx = None
        if spec:
            ctx = DraftContext(self.drafter)
            ctx.extend(feats, torch.arange(P, device=dev)[None])
        anchor = self._pick(logits[0, -1], params, gen) if forced is None else int(forced[0])
        done = stop.push(anchor)
        clock.lap("prefill")
        while not done:
            if P + 1 >= self.max_positions:
                stop.finish_reason = "length"
                break
            if not spec or P + B > self.max_positions:  # AR step (also a drafter's fallback at the context edge)
                logits, feats = tgt.forward(torch.tensor([[anchor]], device=dev), cache, layer_ids)
                if spec:
                    ctx.extend(feats, torch.tensor([[P]], device=dev))
                P += 1
                anchor = self._pick(logits[0, -1], params, gen) if forced is None else int(forced[P - len(ids)])
                done = stop.push(anchor)
                clock.lap("ar_step")
                continue
            Bd = tree.depth + 1 if tree is not None else self.draft_block
            pos = torch.arange(P, P + Bd, device=dev)
            block = self.drafter.block_inputs(torch.tensor([[anchor]], device=dev), Bd)
            out = self.drafter(block, pos[None, None], ctx.kv)
            clock.lap("draft")
            if tree is not None:
                visible = torch.ones(1, P, dtype=torch.bool, device=dev)
                toks, _, path = _tree_round(
                    tgt, self.drafter, tree, out, anchor, P, cache, ctx, visible, clock, params, gen
                )
                stats.record(len(toks) - 1)
                self.tree_profile.record(path)
                P += len(toks)
                done = any(stop.push(tok) for tok in toks)
                anchor = toks[-1]
                clock.lap("commit")
                continue
            prop = propose(self.drafter, out, params, gen, self.draft_len)
            drafts = prop.tokens  # (1, D)
            clock.lap("propose")
            logits, feats = tgt.forward(torch.cat([torch.tensor([[anchor]], device=dev), drafts], 1), cache, layer_ids)
            clock.lap("verify")
            if forced is None:
                n_acc, nxt = verify(prop, logits, params, gen)
            else:  # forced[P - len(ids)] is the anchor; the drafts face the tokens after it
                n_acc, nxt = verify_forced(drafts, forced[P - len(ids) + 1 :])
            n = int(n_acc[0])
            stats.record(n)
            tgt.crop_cache(cache, P + n + 1)
            ctx.extend(feats[:, : n + 1], pos[None, : n + 1])
            P += n + 1
            for tok in drafts[0, :n].tolist() + [int(nxt[0])]:
                if stop.push(tok):
                    done = True
                    break
            anchor = int(nxt[0])
            clock.lap("commit")  # acceptance test, cache crop, drafter context, stop checks
        return GenerationResult(
            token_ids=stop.tokens,
            text=stop.result_text(),
            finish_reason=stop.finish_reason or "length",
            prompt_tokens=len(ids),
            method=self.method,
            stats=stats,
            seconds=time.perf_counter() - t0,
            timings=clock.totals,
        )


def generate_batch(
    engine: Engine,
    prompts: list,
    params: SamplingParams | list[SamplingParams] | None = None,
    on_tokens: list | None = None,
    forced: list | None = None,
) -> list[GenerationResult]:
    """Decode several requests together (one target forward and one drafter forward per round for all rows)
    -> one GenerationResult per prompt. See BatchDecode."""
    if not prompts:
        return []
    run = BatchDecode(engine, prompts, params, on_tokens, forced=forced)
    out = dict(run.pop_finished())
    while not run.done:
        run.step()
        out.update(run.pop_finished())
    return [out[i] for i in range(len(prompts))]


def generate_stream(
    engine: Engine, prompts: list, params=None, concurrency: int = 8, timings: dict | None = None
) -> list[GenerationResult]:
    """Decode the prompts with at most `concurrency` in flight (continuous batching, as `dspine serve`
    schedules): each round runs every open row; a finished row leaves at once and the next prompt, prefilled
    apart, joins the running batch -> one GenerationResult per prompt, in order. `params`: one SamplingParams
    or one per prompt (drawing tokens alike, as BatchDecode's rows). `timings` (a dict) gains "prefill_s", the
    seconds spent prefilling joining prompts, and "rounds", the batched rounds run."""
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency}: at least 1")
    per = params if isinstance(params, list) else [params] * len(prompts)
    out: dict = {}
    run, nxt = None, 0
    while nxt < len(prompts) or (run is not None and not run.done):
        free = concurrency - (len(run) if run is not None else 0)
        if free > 0 and nxt < len(prompts):
            take = list(range(nxt, min(nxt + free, len(prompts))))
            t0 = time.perf_counter()
            new = BatchDecode(engine, [prompts[i] for i in take], [per[i] for i in take], tags=take)
            nxt = take[-1] + 1
            out.update(new.pop_finished())
            if timings is not None:
                timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
            if len(new):
                if run is None or not len(run):
                    run = new
                else:
                    run.merge(new)
            continue  # fill up before the next round
        run.step()
        out.update(run.pop_finished())
        if timings is not None:
            timings["rounds"] = timings.get("rounds", 0) + 1
    return [out[i] for i in range(len(prompts))]


_PREFILL_MIN = 32  # a prompt shorter than this costs a forward about what one of this length does (weights stream)


def _prefill(tgt: Target, ids: list[list[int]], layer_ids):
    """Prompts -> (target cache, valid (N, L), logits at each prompt's last token (N, V), the layer features
    (N, L, F) or None). One forward over the prompts padded to the longest, or, where that padding would cost
    more than the extra forwards, one forward per prompt and the caches padded together with masked columns."""
    N, lens, dev = len(ids), [len(x) for x in ids], tgt.device
    L = max(lens)
    valid = torch.arange(L, device=dev)[None] < torch.tensor(lens, device=dev)[:, None]
    last = torch.tensor(lens, device=dev) - 1
    if N == 1 or sum(max(n, _PREFILL_MIN) for n in lens) >= N * L:
        cache, pos = tgt.new_cache(), torch.arange(L, device=dev).expand(N, L)
        inp = torch.tensor([x + [x[-1]] * (L - len(x)) for x in ids], device=dev)
        logits, feats = tgt.forward(inp, cache, layer_ids, valid.long(), pos, logits_at=last)
        return cache, valid, logits[:, 0], feats
    caches, logits, feats = [], [], []
    for x, at in zip(ids, last):
        caches.append(tgt.new_cache())
        lg, ft = tgt.forward(torch.tensor([x], device=dev), caches[-1], layer_ids, logits_at=at[None])
        logits.append(lg[:, 0])
        feats.append(ft)
    feats = torch.cat([_pad_columns(f, L) for f in feats]) if layer_ids is not None else None
    return _stack_caches(caches, L), valid, torch.cat(logits), feats


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (..., C, x) -> (..., width, x), zeros after: a cache's or a feature tensor's columns (masked)."""
    return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[-2]))


def _stack_caches(caches: list, width: int):
    """Target caches of rows side by side -> the first, holding every row (layers' (N, H, C, hd)), each
    padded to `width` columns."""
    first = caches[0]
    for j, layer in enumerate(first.layers):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = torch.cat([_pad_columns(c.layers[j].keys, width) for c in caches])
            layer.values = torch.cat([_pad_columns(c.layers[j].values, width) for c in caches])
    return first


def _logprob(raw: torch.Tensor, tok: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """raw logits (V,) -> (log p(tok), the top k as (id, log p)) of the target's own distribution."""
    lsm = raw.float().log_softmax(-1)
    top = lsm.topk(k) if k else None
    return float(lsm[tok]), (list(zip(top.indices.tolist(), top.values.tolist())) if k else [])


class BatchDecode:
    """A batch of requests decoded round by round: `step()` runs one round for every row, so a scheduler can
    interleave several batches and move rows in and out between rounds.

    Rows advance by different amounts: each row's target KV cache and drafter context keep the positions fed
    up to the longest acceptance of the round (the rest is cropped), and one validity mask (N, columns) hides
    what a row did not commit (prompt padding, rejected drafts, another row's columns); positions are passed
    explicitly (committed tokens so far). A batch of one row thus keeps only what it committed, as
    Engine.generate does. Keys carry their positions (RoPE), so a row's columns may sit anywhere: that is what
    lets rows leave (`pop_finished`: finished rows' results out, their state dropped), join (`merge`: another
    batch, prefilled apart, padded to the wider of the two with masked columns) and be squeezed (`compact`:
    every row's committed columns moved to the front, the columns no row needs cut).

    `params` is one SamplingParams or one per row: rows may differ in max_tokens, stop, ignore_eos, penalties
    and logprobs, not in how tokens are drawn (temperature, top-k, top-p; one generator, seeded from the first
    row). Penalties apply to the target's logits at every verify position as AR would have applied them after
    the drafts before it (sampling.penalize), so decoding stays AR's. Logprobs are the target's raw
    distribution (before temperature, top-k/p and penalties). `on_tokens[i]` sees row i's tokens as they are
    committed (False aborts that row); `tags[i]` names row i in what pop_finished returns (default: i).
    `forced[i]` (a list of token ids, or None) makes row i a replay of that text, as `Engine.generate(forced=)`
    does for one request: greedy only, ends where the text ends."""

    _ROW_LISTS = ("lens", "tags", "peak", "t0", "stats", "stops", "anchors", "finished", "forced", "accept")  # per row

    @torch.no_grad()
    def __init__(
        self, engine: Engine, prompts: list, params=None, on_tokens: list | None = None, tags=None, forced=None
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
        self.tags = list(tags) if tags is not None else list(range(N))
        self.peak = [N] * N
        self.gen = _generator(dev, params.seed)
        self.t0 = [time.perf_counter()] * N
        self.layer_ids = drafter.config.target_layer_ids if drafter is not None else None
        self.B = drafter.config.block_size if drafter is not None else 1
        self.stats = [AcceptanceStats(self.B) if drafter is not None else None for _ in range(N)]
        self.accept = [engine.policy.new_row() if engine.policy is not None else None for _ in range(N)]
        self.stops = [_Stopper(tgt, r, cb) for r, cb in zip(rows, on_tokens or [None] * N)]
        V = tgt.info.vocab_size
        self.counts = torch.zeros(N, V, device=dev) if any(r.penalized for r in rows) else None  # output tokens
        self.cache, self.valid, last, feats = _prefill(tgt, ids, self.layer_ids)  # valid (N, L)
        pos = torch.arange(self.width, device=dev).expand(N, -1)
        self.committed = torch.tensor(self.lens, device=dev)  # tokens each row has in its cache = the anchor's position
        self.anchors = [
            engine._pick(last[i], params, self.gen) if f is None else int(f[0]) for i, f in enumerate(self.forced)
        ]
        self.finished = [self._push(i, a, last[i]) for i, a in enumerate(self.anchors)]
        self.ctx = None
        if drafter is not None:
            self.ctx = DraftContext(drafter)
            self.ctx.extend(feats, pos)

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
        lp = _logprob(raw, tok, stop.params.logprobs) if stop.params.logprobs is not None else None
        if self.counts is not None:
            self.counts[i, tok] += 1
        return stop.push(tok, lp)

    @torch.no_grad()
    def step(self) -> None:
        """One round for every row (a no-op once all rows are done)."""
        if self.done:
            return
        engine, drafter, tgt = self.engine, self.drafter, self.engine.target
        dev, N, B, params = tgt.device, len(self), self.B, self.params
        edge = (self.committed + B > engine.max_positions).tolist()  # rows at the end of the context
        for i, e in enumerate(edge):
            if e and not self.finished[i]:
                self.stops[i].finish_reason, self.finished[i] = "length", True
        if self.done:
            return
        open_rows = len(self) - sum(self.finished)
        spec = drafter is not None and (engine.spec_max_batch is None or open_rows <= engine.spec_max_batch)
        if spec and engine.tree is not None and len(self) == 1 and self.counts is None:
            if self.forced[0] is None:
                return self._tree_step()
        k = self._drafts(N) if spec else 0
        spec, t_round = k > 0, time.perf_counter()
        Bd = engine.draft_block - engine.draft_len + k if spec else 1  # the slots the drafter runs
        pos = self.committed[:, None] + torch.arange(Bd, device=dev)  # (N, Bd); 1 for AR
        anchor_t = torch.tensor(self.anchors, device=dev)[:, None]
        prop = None
        if spec:
            mask = block_attention_mask(self.valid[:, None], Bd, drafter.config.is_causal)
            out = drafter(drafter.block_inputs(anchor_t, Bd), pos[:, None], self.ctx.kv, mask)
            prop = propose(drafter, out, params, self.gen, k)
            feed = torch.cat([anchor_t, prop.tokens], 1)
        else:
            feed = anchor_t
        pos = pos[:, : feed.shape[1]]
        fed_valid = torch.cat([self.valid, self.valid.new_ones(N, feed.shape[1])], 1).long()
        logits, feats = tgt.forward(feed, self.cache, self.layer_ids, fed_valid, pos)
        chosen = self._penalized(logits, prop)  # what tokens are chosen from
        if prop is not None:
            n_acc, nxt = verify(prop, chosen, params, self.gen)
        else:
            n_acc = torch.zeros(N, dtype=torch.long, device=dev)
            nxt = torch.tensor([engine._pick(chosen[i, -1], params, self.gen) for i in range(N)], device=dev)
        if any(f is not None for f in self.forced):
            n_acc, nxt = self._forced_verdicts(n_acc, nxt, prop)
        # keep the anchor + accepted drafts (masked per row); columns no row accepted are cropped away
        m = int(n_acc.max()) + 1
        kept = torch.arange(m, device=dev)[None] <= n_acc[:, None]  # (N, m)
        tgt.crop_cache(self.cache, self.width + m)
        self.valid = torch.cat([self.valid, kept], 1)
        if drafter is not None:  # an AR round's token too (projected when drafting resumes)
            self.ctx.extend(feats[:, :m], pos[:, :m], lazy=prop is None)
        self.committed = self.committed + n_acc + 1
        if engine.policy is not None:
            self._observe(k, n_acc, feed.shape[1], time.perf_counter() - t_round)
        self._commit(n_acc, nxt, prop, logits)
        self.compact()  # rows that accepted less than the round's longest leave masked holes

    def _drafts(self, N: int) -> int:
        """This round's draft length: the engine's, or its policy's choice over the open rows (0: a round without
        drafts). Columns waiting from earlier rounds are projected before a drafting round is timed (their cost)."""
        k, policy = self.engine.draft_len, self.engine.policy
        if policy is not None:
            k = policy.choose([a for a, f in zip(self.accept, self.finished) if not f], N)
        if k:
            self.ctx.project()
        return k

    def _observe(self, k: int, n_acc: torch.Tensor, width: int, seconds: float) -> None:
        """The policy learns the round: each open row's acceptance of its k drafts, the round's cost."""
        policy = self.engine.policy
        if k:
            for i in [i for i, f in enumerate(self.finished) if not f]:
                policy.record(self.accept[i], k, int(n_acc[i]))
        policy.observe(len(self) * width, k > 0, seconds, (len(self), k))

    def _tree_step(self) -> None:
        """A round of a single-row batch through the engine's draft tree (_tree_round)."""
        drafter, tgt, tree = self.drafter, self.engine.target, self.engine.tree
        dev, Bd, anchor = tgt.device, tree.depth + 1, self.anchors[0]
        pos = self.committed[:, None] + torch.arange(Bd, device=dev)  # (1, Bd)
        mask = block_attention_mask(self.valid[:, None], Bd, drafter.config.is_causal)
        out = drafter(drafter.block_inputs(torch.tensor([[anchor]], device=dev), Bd), pos[:, None], self.ctx.kv, mask)
        P, clock = int(self.committed[0]), _PhaseClock(dev, False)
        toks, raw, path = _tree_round(
            tgt, drafter, tree, out, anchor, P, self.cache, self.ctx, self.valid, clock, self.params, self.gen
        )
        self.engine.tree_profile.record(path)
        self.valid = torch.cat([self.valid, self.valid.new_ones(1, len(toks))], 1)
        self.committed = self.committed + len(toks)
        self.stats[0].record(len(toks) - 1)
        self.finished[0] = any(self._push(0, tok, raw[j]) for j, tok in enumerate(toks))
        self.anchors[0] = toks[-1]

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
        self.cache = _stack_caches([self.cache, other.cache], C)
        if self.ctx is not None:
            pair = lambda a, b: torch.cat([_pad_columns(a, C), _pad_columns(b, C)])
            self.ctx.kv = [(pair(k0, k1), pair(v0, v1)) for (k0, v0), (k1, v1) in zip(self.ctx.kv, other.ctx.kv)]
        if self.counts is not None or other.counts is not None:
            V = self.engine.target.info.vocab_size
            z = lambda b: b.counts if b.counts is not None else torch.zeros(len(b), V, device=b.valid.device)
            self.counts = torch.cat([z(self), z(other)])
        self.valid, self.committed = torch.cat([self.valid, other.valid]), torch.cat([self.committed, other.committed])
        for name in self._ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak = [max(p, len(self)) for p in self.peak]

    def _result(self, i: int) -> GenerationResult:
        s = self.stops[i]
        return GenerationResult(
            token_ids=s.tokens,
            text=s.result_text(),
            finish_reason=s.finish_reason or "length",
            prompt_tokens=self.lens[i],
            method=self.engine.method,
            stats=self.stats[i],
            seconds=time.perf_counter() - self.t0[i],
            batch_size=self.peak[i],
            logprobs=s.logprobs,
        )


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
    next (N,)). Used by distribution tests and offline evaluation; the engine's cached loop calls the same
    `propose` and verifiers.
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
    n_acc, nxt = verify(prop, logits, params, generator, verifier)
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
