"""The Grafana dashboard only queries metrics the server and the proxy callback export."""

import json
import re
from pathlib import Path

from conftest import tiny_target

from dspine.engine import Engine
from dspine.serve.server import Service

DASH = Path(__file__).resolve().parents[1] / "dspine" / "serve" / "grafana_dashboard.json"


def test_grafana_dashboard_queries_exported_metrics():
    from prometheus_client import generate_latest

    svc = Service(Engine(tiny_target("llama")))
    svc.metrics.observe(
        {
            "workload": "swe",
            "thinking": "low",
            "method": "dspine",
            "completion_tokens": 5,
            "latency_s": 0.2,
            "spec": {"spec_verify_ct": 2, "spec_num_correct_drafts": 3, "spec_accept_length": 2.5},
        }
    )
    svc.metrics.errors.labels("400").inc()
    from dspine.serve.litellm_hooks import _metrics

    proxy = _metrics(0)  # the proxy callback's metrics (default registry; no HTTP server with port 0)
    lab = dict(model="m", drafter="d", workload="swe", thinking="low")
    for name in ("requests", "rounds", "committed", "accepted"):
        proxy[name].labels(**lab).inc()
    proxy["tau"].labels(**lab).observe(2.0)
    proxy["latency"].labels(**lab).observe(0.1)
    proxy["lost"].labels(model="m").inc()
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
