"""The embedded engine: autoregressive and speculative decoding over a KV-cached target.

Per request the state is: committed tokens; the target's KV cache holding every committed position but the
last (the anchor, fed with the next block); the drafter's context K/V for the same positions. A speculative
round drafts B-1 tokens from [anchor, mask...], verifies [anchor, drafts] in one causal target forward,
commits the accepted drafts plus the target's own next token, crops the target cache back to the committed
positions and appends their target features to the drafter's context. AR decoding is the same loop with
no drafts. Every committed token passes through one stop checker (EOS, max tokens, stop strings), so
speculative and AR outputs end exactly alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspine.decoding import propose
from dspine.drafter import DSpineDraftModel, block_attention_mask
from dspine.sampling import RequestError, SamplingParams, sample, warp_probs
from dspine.stats import AcceptanceStats
from dspine.target import Target
from dspine.verify import verify_greedy, verify_sampled


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
    batch_size: int = 1  # requests decoded together with this one (generate_batch)

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

    def push(self, tok: int) -> bool:
        if tok in self.eos:
            self.finish_reason = "stop"
            return True
        self.tokens.append(tok)
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


class DraftContext:
    """The drafter's per-layer context K/V for committed positions (grows; block K/V are never kept)."""

    def __init__(self, drafter: DSpineDraftModel):
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def extend(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """feats (N, n, m*d), pos (N, n)."""
        new = self.drafter.context_kv(feats, pos)
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.kv, new)]


class Engine:
    """Generate with a target alone (`method="ar"`) or with a DSpine/DFlash/post-backbone drafter."""

    def __init__(self, target: Target, drafter: DSpineDraftModel | None = None, draft_len: int | None = None):
        """`draft_len`: drafts verified per round (1 .. block_size-1; default block_size-1), a decode-time
        choice: each draft costs a row of the target's verify forward."""
        self.target = target
        self.drafter = drafter.bind(target) if drafter is not None else None
        self.method = drafter.config.method if drafter is not None else "ar"
        B = drafter.config.block_size if drafter is not None else 1
        if draft_len is not None and not 1 <= draft_len <= B - 1:
            raise ValueError(f"draft_len must be in [1, {B - 1}] for this drafter (block size {B}), got {draft_len}")
        self.draft_len = draft_len or max(B - 1, 0)
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

        cache = tgt.new_cache()
        logits, feats = tgt.forward(torch.tensor([ids], device=dev), cache, layer_ids)
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
            pos = torch.arange(P, P + B, device=dev)
            block = self.drafter.block_inputs(torch.tensor([[anchor]], device=dev), B)
            out = self.drafter(block, pos[None, None], ctx.kv)
            clock.lap("draft")
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


def _finish_open_rows(stops: list, done: list[bool], reason: str) -> None:
    for i, d in enumerate(done):
        if not d:
            stops[i].finish_reason, done[i] = reason, True


def generate_batch(
    engine: Engine,
    prompts: list,
    params: SamplingParams | list[SamplingParams] | None = None,
    on_tokens: list | None = None,
) -> list[GenerationResult]:
    """Decode several requests together (one target forward and one drafter forward per round for all rows)
    -> one GenerationResult per prompt. See BatchDecode."""
    if not prompts:
        return []
    run = BatchDecode(engine, prompts, params, on_tokens)
    while not run.done:
        run.step()
    return run.results()


class BatchDecode:
    """A batch of requests decoded round by round: `step()` runs one round for every row, so a scheduler can
    interleave several batches (the server lets a new batch start while a long one is still decoding).

    Rows advance by different amounts: each row's target KV cache and drafter context keep the positions fed
    up to the longest acceptance of the round (the rest is cropped), and a validity mask (N, positions) hides
    what a row did not commit (prompt padding, rejected drafts); positions are passed explicitly (committed
    tokens so far). A batch of one row thus keeps only what it committed, as Engine.generate does. A row that
    has finished keeps riding along until all have; its tokens are not recorded. `params` is one
    SamplingParams or one per row: rows may differ in max_tokens, stop and ignore_eos, not in how tokens are
    drawn (temperature, top-k, top-p; one generator, seeded from the first row). `on_tokens[i]` sees row i's
    tokens as they are committed (False aborts that row)."""

    @torch.no_grad()
    def __init__(self, engine: Engine, prompts: list, params=None, on_tokens: list | None = None):
        per_row = params if isinstance(params, list) else [params] * len(prompts)
        rows = [(p or SamplingParams()).validate() for p in per_row]
        self.params = params = rows[0]
        if any((r.temperature, r.top_k, r.top_p) != (params.temperature, params.top_k, params.top_p) for r in rows):
            raise ValueError("rows of one batch must share temperature, top_k and top_p")
        self.engine, self.drafter = engine, engine.drafter
        tgt, dev, drafter = engine.target, engine.target.device, engine.drafter
        ids = [engine.prompt_ids(p) for p in prompts]
        N, self.lens = len(ids), [len(x) for x in ids]
        self.gen = _generator(dev, params.seed)
        self.t0 = time.perf_counter()
        self.layer_ids = drafter.config.target_layer_ids if drafter is not None else None
        self.B = drafter.config.block_size if drafter is not None else 1
        self.W = engine.draft_len + 1  # rows fed to the target per round: the anchor and the drafts
        self.stats = [AcceptanceStats(self.B) if drafter is not None else None for _ in range(N)]
        self.stops = [_Stopper(tgt, r, cb) for r, cb in zip(rows, on_tokens or [None] * N)]
        L = max(self.lens)
        inp = torch.tensor([x + [x[-1]] * (L - len(x)) for x in ids], device=dev)
        self.valid = torch.arange(L, device=dev)[None] < torch.tensor(self.lens, device=dev)[:, None]  # (N, L)
        self.cache = tgt.new_cache()
        pos = torch.arange(L, device=dev).expand(N, L)
        logits, feats = tgt.forward(inp, self.cache, self.layer_ids, self.valid.long(), pos)
        self.committed = torch.tensor(self.lens, device=dev)  # tokens each row has in its cache = the anchor's position
        self.anchors = [engine._pick(logits[i, n - 1], params, self.gen) for i, n in enumerate(self.lens)]
        self.finished = [self.stops[i].push(a) for i, a in enumerate(self.anchors)]
        self.ctx = self.ctx_valid = None
        if drafter is not None:
            self.ctx, self.ctx_valid = DraftContext(drafter), self.valid
            self.ctx.extend(feats, pos)

    @property
    def done(self) -> bool:
        return all(self.finished)

    @torch.no_grad()
    def step(self) -> None:
        """One round for every row (a no-op once all rows are done)."""
        if self.done:
            return
        engine, drafter, tgt = self.engine, self.drafter, self.engine.target
        dev, N, B, W, params = tgt.device, len(self.lens), self.B, self.W, self.params
        if int(self.committed.max()) + B > engine.max_positions:
            _finish_open_rows(self.stops, self.finished, "length")
            return
        pos = self.committed[:, None] + torch.arange(B, device=dev)  # (N, B); B = 1 for AR
        anchor_t = torch.tensor(self.anchors, device=dev)[:, None]
        prop = None
        if drafter is not None:
            mask = block_attention_mask(self.ctx_valid[:, None], B, drafter.config.is_causal)
            out = drafter(drafter.block_inputs(anchor_t, B), pos[:, None], self.ctx.kv, mask)
            prop = propose(drafter, out, params, self.gen, engine.draft_len)
            feed = torch.cat([anchor_t, prop.tokens], 1)
        else:
            feed = anchor_t
        pos = pos[:, :W]
        fed_valid = torch.cat([self.valid, self.valid.new_ones(N, W)], 1).long()
        logits, feats = tgt.forward(feed, self.cache, self.layer_ids, fed_valid, pos)
        if prop is not None:
            n_acc, nxt = verify(prop, logits, params, self.gen)
        else:
            n_acc = torch.zeros(N, dtype=torch.long, device=dev)
            nxt = torch.tensor([engine._pick(logits[i, -1], params, self.gen) for i in range(N)], device=dev)
        # keep the anchor + accepted drafts (masked per row); columns no row accepted are cropped away
        m = int(n_acc.max()) + 1
        kept = torch.arange(m, device=dev)[None] <= n_acc[:, None]  # (N, m)
        tgt.crop_cache(self.cache, self.valid.shape[1] + m)
        self.valid = torch.cat([self.valid, kept], 1)
        if drafter is not None:
            self.ctx.extend(feats[:, :m], pos[:, :m])
            self.ctx_valid = torch.cat([self.ctx_valid, kept], 1)
        self.committed = self.committed + n_acc + 1
        for i in range(N):
            if self.finished[i]:
                continue
            n = int(n_acc[i])
            if self.stats[i] is not None:
                self.stats[i].record(n)
            for tok in (prop.tokens[i, :n].tolist() if prop is not None else []) + [int(nxt[i])]:
                if self.stops[i].push(tok):
                    self.finished[i] = True
                    break
            self.anchors[i] = int(nxt[i])

    def results(self) -> list[GenerationResult]:
        secs = time.perf_counter() - self.t0
        return [
            GenerationResult(
                token_ids=s.tokens,
                text=s.result_text(),
                finish_reason=s.finish_reason or "length",
                prompt_tokens=n,
                method=self.engine.method,
                stats=st,
                seconds=secs,
                batch_size=len(self.lens),
            )
            for s, n, st in zip(self.stops, self.lens, self.stats)
        ]


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
