"""The Grafana dashboard only queries metrics the server and the proxy callback export."""

import json
import re
from pathlib import Path

from conftest import tiny_target

from dspine.engine import Engine
from dspine.serve.records import RequestRecord
from dspine.serve.server import Service

DASH = Path(__file__).resolve().parents[1] / "dspine" / "serve" / "grafana_dashboard.json"


def test_grafana_dashboard_queries_exported_metrics():
    from prometheus_client import generate_latest

    svc = Service(Engine(tiny_target("llama")))
    rec = RequestRecord(
        request_id="r",
        model="m",
        drafter="d",
        method="dspine",
        workload="swe",
        thinking="low",
        completion_tokens=5,
        latency_s=0.2,
        accept_hist=[0, 1, 1, 0],
    )
    svc.metrics.acceptance.observe(rec)
    svc.metrics.errors.labels("400").inc()
    from dspine.serve.litellm_hooks import _metrics

    proxy = _metrics(0)  # the proxy callback's metrics (default registry; no HTTP server with port 0)
    proxy.observe(rec)
    proxy.lost.labels(model="m").inc()
    text = generate_latest(svc.metrics.registry).decode() + generate_latest().decode()
    exported = set(re.findall(r"^(dspine_[a-z_]+)", text, re.M))
    dash = json.loads(DASH.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 6 and exprs
    used = {m for e in exprs for m in re.findall(r"dspine_[a-z_]+", e)}
    assert used and used <= exported, used - exported
    for e in exprs:  # labels grouped on exist on the metrics
        for labels in re.findall(r"by \(([^)]*)\)", e):
            assert set(map(str.strip, labels.split(","))) <= {
                "workload",
                "thinking",
                "method",
                "le",
                "code",
                "model",
                "drafter",
            }
