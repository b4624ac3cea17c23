"""Each batched round's draft length, and a single request's tree when suffix drafts join it (TreePolicy), chosen
by goodput — the tokens expected to be committed per second of the round (SmartSpec's criterion; vLLM's dynamic
speculative decoding; the cost-aware trees of Sequoia and EAGLE-2). Where verifying a row costs
almost nothing (one request, or a GPU far from its compute bound) the longest draft wins; where each verified row
costs compute (a few CPU cores, a full batch) the policy drafts less, or not at all, for the rows it expects to
reject.

Expected tokens of row i drafting k: E_i(k) = 1 + sum_{j<=k} prod_{m<=j} a_{i,m}, with a_{i,m} the rate at which
row i's slot m was accepted when its round reached that slot, shrunk toward the engine's rate over all rows
(`PRIOR` rounds' weight); the engine's rate starts at `START_RATE` so that drafting is tried before anything
is known.

A round's seconds: a line a + b·r + c·s in the target rows it feeds (r = N·(k+1)) and whether it drafts (s),
least-squares fitted to the engine's measured rounds (but the first of each shape, which pays for building its
kernels: oneDNN's primitives, Triton's JIT), older rounds forgotten (`DECAY` per round) and the slopes
pulled toward 0 by a small ridge. The first round drafts all; while the rounds seen fed about the same number of
rows (the slope unknown: the first rounds, or a long stretch of one batch size once the older rounds are
forgotten), the next round feeds the most different number of rows it can, and so measures it.

The choice changes only how many drafts a round verifies, never what is committed: every round is verified as
the fixed-length rounds are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dspine.decoding import DraftTree
    from dspine.state import TreeProfile
    from dspine.suffix import SuffixConfig, SuffixDraft

START_RATE = 0.7
PRIOR = 4.0
DECAY = 0.98
RIDGE = 1.0
KNOWN_ROUNDS = 8  # tree rounds fitted before their cost line is trusted


class RowAcceptance:
    """One row's counts per draft slot 1..K: rounds that reached the slot, and those that accepted it."""

    __slots__ = ("acc", "reach")

    def __init__(self, K: int):
        self.reach, self.acc = [0.0] * K, [0.0] * K

    def record(self, drafted: int, accepted: int) -> None:
        """A round that verified `drafted` drafts and accepted the first `accepted` of them."""
        for m in range(min(accepted + 1, drafted)):
            self.reach[m] += 1
            self.acc[m] += m < accepted


class CostLine:
    """A round's seconds as a line a + b·r + c·s in the target rows it feeds (r) and whether the drafter ran (s),
    least-squares fitted to measured rounds (module docstring)."""

    def __init__(self):
        self.gram = torch.zeros(3, 3, dtype=torch.float64)  # decayed sum of x x^T, x = (1, r, s)
        self.moment = torch.zeros(3, dtype=torch.float64)  # decayed sum of x * seconds
        self.shapes: set = set()  # round shapes seen (their first round is not fitted)

    def observe(self, rows_fed: int, drafted: bool, seconds: float, shape=None) -> None:
        """A round's measured seconds, with the target rows it fed and whether it drafted; `shape` (any hashable,
        default (rows_fed, drafted)): rounds of a shape not seen before are not fitted (kernels being built)."""
        shape = (rows_fed, drafted) if shape is None else shape
        if shape not in self.shapes:
            self.shapes.add(shape)
            return
        x = torch.tensor([1.0, rows_fed, float(drafted)], dtype=torch.float64)
        self.gram.mul_(DECAY).add_(torch.outer(x, x))
        self.moment.mul_(DECAY).add_(x * seconds)

    def fit(self) -> tuple[float, float, float]:
        """The cost line's (a, b, c); zeros before any round was measured."""
        if not self.gram[0, 0]:
            return 0.0, 0.0, 0.0
        ridge = torch.diag(torch.tensor([0.0, RIDGE, RIDGE], dtype=torch.float64))
        return tuple(torch.linalg.solve(self.gram + ridge, self.moment).tolist())

    def seconds(self, rows_fed: int, drafted: bool, line: tuple[float, float, float] | None = None) -> float:
        """The fitted seconds of a round feeding `rows_fed` target rows (0 before any round was measured)."""
        a, b, c = line or self.fit()
        return a + b * rows_fed + c * drafted

    def spread(self, i: int) -> float:
        """The (decayed) variance of feature i (1: rows fed, 2: drafted) over the fitted rounds."""
        n = float(self.gram[0, 0])
        return float(self.gram[i, i]) / n - (float(self.gram[0, i]) / n) ** 2 if n else 0.0


class DraftPolicy(CostLine):
    """An engine's goodput choice of draft length in [0, max_len] for a batched round (module docstring)."""

    def __init__(self, max_len: int):
        if max_len < 1:
            raise ValueError(f"max_len {max_len}: at least 1")
        super().__init__()
        self.K = max_len
        self.rows = RowAcceptance(max_len)  # all rows' counts, the prior of each one's

    def new_row(self) -> RowAcceptance:
        return RowAcceptance(self.K)

    def record(self, row: RowAcceptance, drafted: int, accepted: int) -> None:
        """Row `row` verified `drafted` drafts this round and accepted `accepted`."""
        row.record(drafted, accepted)
        self.rows.record(drafted, accepted)

    def rates(self, row: RowAcceptance) -> list[float]:
        """a_{i,m} for m = 1..K: the row's acceptance rate per slot, shrunk toward all rows'."""
        return self._shrunk(row, self._overall())

    def _overall(self) -> list[float]:
        return [(a + PRIOR * START_RATE) / (r + PRIOR) for a, r in zip(self.rows.acc, self.rows.reach)]

    @staticmethod
    def _shrunk(row: RowAcceptance, prior: list[float]) -> list[float]:
        return [(a + PRIOR * p) / (r + PRIOR) for a, r, p in zip(row.acc, row.reach, prior)]

    def expected(self, rows: list[RowAcceptance]) -> list[float]:
        """E(k) = sum_i E_i(k) for k = 0..K: the tokens the rows are expected to commit drafting k."""
        out = [float(len(rows))] + [0.0] * self.K
        prior = self._overall()
        for row in rows:
            p = 1.0
            for m, a in enumerate(self._shrunk(row, prior), 1):
                p *= a
                out[m] += p
        for k in range(1, self.K + 1):
            out[k] += out[k - 1]
        return out

    def choose(self, rows: list[RowAcceptance], batch: int) -> int:
        """The draft length for a round over `batch` rows (the forward's), `rows` the open ones' counts."""
        if not rows:
            return 0
        if not self.gram[0, 0]:  # no round measured yet: draft all
            return self.K
        if self.spread(1) < 1.0:  # every round fed about the same rows: measure another size first
            mean = float(self.gram[0, 1] / self.gram[0, 0])
            return max(range(self.K + 1), key=lambda k: abs(batch * (k + 1) - mean))
        gains, line = self.expected(rows), self.fit()
        costs = [max(self.seconds(batch * (k + 1), k > 0, line), 1e-6) for k in range(self.K + 1)]
        return max(range(self.K + 1), key=lambda k: gains[k] / costs[k])


class SuffixChainPolicy(CostLine):
    """A batched round's chain length when suffix drafts alone propose. Each row drafts its best path; a shorter
    path (or none) is padded with its last token — a pad is verified like any draft, so it is kept only where the
    target would have chosen it, and at T > 0 it is a certain proposal (q = 1 on it) like every suffix draft.
    Expected committed tokens of row i at length k: 1 + the sum of its path's node scores up to k (the fraction of
    the match's occurrences that continue through each node, suffix.SuffixDraft); the k with the most per second
    of the round's fitted cost wins. Until that line is known (KNOWN_ROUNDS fitted rounds of different widths), the
    longest length every open row fills, as without padding — one row without a match then makes the round AR.
    `pad=False` (SuffixConfig.pad_batches off, the default) keeps that rule always."""

    def __init__(self, pad: bool = True):
        super().__init__()
        self.pad = pad

    def choose(self, drafts: list, batch: int, cap: int) -> int:
        """The chain length for a round over `batch` rows (the forward's), `drafts` the open rows' SuffixDrafts
        (None: no match), at most `cap`."""
        paths = [[sd.scores[j] for j in sd.best_path()] if sd else [] for sd in drafts]
        if not paths or cap < 1:
            return 0
        fill = min(cap, min(len(p) for p in paths))
        if not self.pad or float(self.gram[0, 0]) < KNOWN_ROUNDS or self.spread(1) < 1.0:
            return fill
        top, line = min(cap, max(len(p) for p in paths)), self.fit()
        gains = [sum(1 + sum(p[:k]) for p in paths) for k in range(top + 1)]
        return max(range(top + 1), key=lambda k: gains[k] / max(self.seconds(batch * (k + 1), k > 0, line), 1e-6))


class TreePolicy(CostLine):
    """A single request's tree round when suffix drafts join it: which nodes of the drafter's static tree (a
    subtree, `DraftTree.greedy_order` over their measured rates), which of the suffix draft's (best score first)
    and whether the drafter runs at all — the choice with the most committed tokens expected per second of the
    round, against the same cost line as the batched rounds fitted to the tree rounds.

    Expected accepted drafts: at each depth j the chance that a kept node there is accepted — the suffix's
    P_s(j), the sum of its nodes' scores at j (the fraction of the match's occurrences that continue through them;
    siblings are exclusive), and the drafter's P_d(j), the sum of its nodes' measured rates (accepted per round
    that verified the node, shrunk toward START_RATE^depth · 2^-rank) — taken as independent: E = Σ_j 1 - (1 -
    P_s(j))(1 - P_d(j)). Nodes enter greedily by their gain in E (a suffix node at j adds score · (1 - P_d(j))), and
    the prefix of that order with the best (1 + f·E) / seconds is verified; f, per plan kind (with or without the
    drafter), is the accepted over the predicted drafts of that kind's past rounds, which absorbs how optimistic
    the scores and the independence are. An AR round (nothing kept) is one of the choices.

    Until the cost line is known (KNOWN_ROUNDS fitted, with different node counts), or always with
    `tree_goodput` off (suffix.SuffixConfig), a round verifies everything: the drafter's whole tree unless the
    suffix alone expects `skip_drafter_tokens` accepted, and the whole suffix draft.
    The choice is made before the drafter runs, from counts of past rounds only: at T > 0 no draft's sample
    decides which nodes are verified, so recursive rejection sampling stays exact."""

    def __init__(self, tree: DraftTree | None, profile: TreeProfile | None, cfg: SuffixConfig):
        super().__init__()
        self.tree, self.profile, self.cfg = tree, profile, cfg
        self.calib = {False: [0.0, 0.0], True: [0.0, 0.0]}  # drafted -> decayed (predicted, accepted) drafts
        self.prior = [START_RATE ** len(p) * 0.5 ** sum(p) for p in tree.paths] if tree is not None else []

    def rates(self) -> list[float]:
        """The static tree's nodes' acceptance rates (per round that verified them), shrunk toward the prior."""
        prof = self.profile
        return [(a + PRIOR * p) / (o + PRIOR) for a, o, p in zip(prof.accepted, prof.offered, self.prior)]

    def known(self) -> bool:
        return float(self.gram[0, 0]) >= KNOWN_ROUNDS and self.spread(1) >= 1.0

    def factor(self, drafted: bool) -> float:
        pred, acc = self.calib[drafted]
        return (acc + PRIOR) / (pred + PRIOR)

    def plan(self, sd: SuffixDraft | None, can_draft: bool) -> tuple[DraftTree | None, SuffixDraft | None, float]:
        """(the drafter's subtree to draft, or None: it does not run; the suffix nodes to verify; the expected
        accepted drafts, uncalibrated) for this round."""
        from dspine.decoding import tree_depths

        sd = sd if sd else None
        can_draft = can_draft and self.tree is not None
        if not self.cfg.tree_goodput:  # every node; the drafter skipped only by the suffix's confidence
            run = can_draft and not (sd and sd.expected_tokens() >= self.cfg.skip_drafter_tokens)
            return (self.tree if run else None), sd, 0.0
        s_depth = tree_depths(sd.parents) if sd else []
        s_order = sorted(range(len(sd)), key=lambda i: (-sd.scores[i], i)) if sd else []
        rates = self.rates() if can_draft else []
        rate = dict(zip(self.tree.paths, rates)) if can_draft else {}
        d_order = self.tree.greedy_order(rates) if can_draft else []
        if not self.known():
            run = can_draft and not (sd and sd.expected_tokens() >= self.cfg.skip_drafter_tokens)
            keep_d = d_order if run else []
            return self._subtree(keep_d), sd, _expected(s_order, s_depth, sd, keep_d, rate)
        if self.spread(2) < 0.01 and sd and can_draft:  # rounds all alike in running the drafter: try the other
            run = float(self.gram[0, 2] / self.gram[0, 0]) < 0.5
            keep_d = d_order if run else []
            return self._subtree(keep_d), sd, _expected(s_order, s_depth, sd, keep_d, rate)
        line = self.fit()
        best = (1.0 / max(self.seconds(1, False, line), 1e-6), [], 0, 0.0)  # (goodput, drafter nodes, suffix n, E)
        for drafted in (False, True) if can_draft and d_order else (False,):
            f, ps, pd = self.factor(drafted), {}, {}
            si, di, e, kept_d = 0, 0, 0.0, []
            while si < len(s_order) or (drafted and di < len(d_order)):
                gs = gd = -1.0
                if si < len(s_order):
                    j = s_depth[s_order[si]]
                    gs = sd.scores[s_order[si]] * (1 - min(pd.get(j, 0.0), 1.0))
                if drafted and di < len(d_order):
                    p = d_order[di]
                    gd = rate[p] * (1 - min(ps.get(len(p), 0.0), 1.0))
                if gd > gs:
                    p = d_order[di]
                    pd[len(p)] = pd.get(len(p), 0.0) + rate[p]
                    kept_d.append(p)
                    di, e = di + 1, e + gd
                else:
                    j = s_depth[s_order[si]]
                    ps[j] = ps.get(j, 0.0) + sd.scores[s_order[si]]
                    si, e = si + 1, e + gs
                if drafted and not kept_d:
                    continue
                good = (1 + f * e) / max(self.seconds(1 + si + di, drafted, line), 1e-6)
                if good > best[0]:
                    best = (good, list(kept_d), si, e)
        _, keep_d, n_s, e = best
        return self._subtree(keep_d), (sd.subset(s_order[:n_s]) if n_s else None), e

    def _subtree(self, paths: list) -> DraftTree | None:
        """The drafter's tree of these nodes (the engine's own when all of them; None when none)."""
        from dspine.decoding import DraftTree

        if not paths:
            return None
        return self.tree if len(paths) == len(self.tree.paths) else DraftTree.of(paths)

    def record(self, drafted: bool, predicted: float, accepted: int, rows_fed: int, seconds: float, shape) -> None:
        """A tree round's outcome: its predicted and accepted drafts, its cost (nothing kept while off)."""
        if not self.cfg.tree_goodput:
            return
        c = self.calib[drafted]
        c[0], c[1] = c[0] * DECAY + predicted, c[1] * DECAY + accepted
        self.observe(rows_fed, drafted, seconds, shape)


def _expected(s_order, s_depth, sd, keep_d, rate) -> float:
    """E = Σ_j 1 - (1 - P_s(j))(1 - P_d(j)) for the suffix nodes s_order and the drafter's nodes keep_d."""
    ps: dict[int, float] = {}
    pd: dict[int, float] = {}
    for i in s_order:
        ps[s_depth[i]] = ps.get(s_depth[i], 0.0) + sd.scores[i]
    for p in keep_d:
        pd[len(p)] = pd.get(len(p), 0.0) + rate[p]
    return sum(1 - (1 - min(ps.get(j, 0.0), 1.0)) * (1 - min(pd.get(j, 0.0), 1.0)) for j in set(ps) | set(pd))
