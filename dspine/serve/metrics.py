"""Prometheus metrics of acceptance, defined once: the server (`dspine_*`, by workload × thinking × method)
and the proxy callback (`dspine_proxy_*`, by model × drafter × workload × thinking) observe the same
RequestRecord into the same families."""

from __future__ import annotations

from dspine.serve.records import RequestRecord

TAU_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)


class AcceptanceMetrics:
    def __init__(self, prefix: str, labels: tuple[str, ...], registry=None):
        from prometheus_client import REGISTRY, Counter, Histogram

        self.labels = labels
        reg = registry if registry is not None else REGISTRY

        def counter(name, doc, lab=labels):
            return Counter(f"{prefix}_{name}", doc, lab, registry=reg)

        self.requests = counter("requests", "finished requests")
        self.tokens = counter("completion_tokens", "generated tokens")
        self.prompt = counter("prompt_tokens", "prompt tokens")
        self.cached = counter("cached_prompt_tokens", "prompt tokens reused from the prefix cache (not prefilled)")
        self.rounds = counter("verify_rounds", "target verify rounds")
        self.accepted = counter("accepted_drafts", "accepted draft tokens")
        self.committed = counter("committed_tokens", "tokens committed in verify rounds (accepted + 1 per round)")
        self.lost = counter("lost_acceptance", "requests whose acceptance could not be found", ("model",))
        self.accept_len = Histogram(
            f"{prefix}_accept_length", "per-request acceptance length τ", labels, buckets=TAU_BUCKETS, registry=reg
        )
        self.latency = Histogram(f"{prefix}_request_seconds", "request latency", labels, registry=reg)

    def observe(self, rec: RequestRecord) -> None:
        lab = [str(v) if (v := getattr(rec, k)) is not None else "none" for k in self.labels]
        self.requests.labels(*lab).inc()
        if rec.completion_tokens:
            self.tokens.labels(*lab).inc(rec.completion_tokens)
        if rec.prompt_tokens:
            self.prompt.labels(*lab).inc(rec.prompt_tokens)
        if rec.cached_tokens:
            self.cached.labels(*lab).inc(rec.cached_tokens)
        if rec.latency_s is not None:
            self.latency.labels(*lab).observe(rec.latency_s)
        stats = rec.stats
        if stats is not None:
            self.rounds.labels(*lab).inc(stats.rounds)
            self.accepted.labels(*lab).inc(stats.accepted)
            self.committed.labels(*lab).inc(stats.accepted + stats.rounds)
            self.accept_len.labels(*lab).observe(stats.tau)
