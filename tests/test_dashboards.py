"""The Grafana dashboard only queries metrics the server exports."""

import json
import re
from pathlib import Path

from conftest import tiny_target
from dspine.engine import Engine
from dspine.server import Service

DASH = Path(__file__).resolve().parents[1] / "dspine" / "assets" / "grafana_dashboard.json"


def test_grafana_dashboard_queries_exported_metrics():
    from prometheus_client import generate_latest

    svc = Service(Engine(tiny_target("llama")))
    svc.metrics.observe({"workload": "swe", "thinking": "low", "method": "dspine", "completion_tokens": 5,
                         "latency_s": 0.2, "spec": {"spec_verify_ct": 2, "spec_num_correct_drafts": 3,
                                                    "spec_accept_length": 2.5}})
    svc.metrics.errors.labels("400").inc()
    exported = set(re.findall(r"^(dspine_[a-z_]+)", generate_latest(svc.metrics.registry).decode(), re.M))
    dash = json.loads(DASH.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 6 and exprs
    used = {m for e in exprs for m in re.findall(r"dspine_[a-z_]+", e)}
    assert used and used <= exported, used - exported
    for e in exprs:  # labels grouped on exist on the metrics
        for labels in re.findall(r"by \(([^)]*)\)", e):
            assert set(map(str.strip, labels.split(","))) <= {"workload", "thinking", "method", "le", "code"}
