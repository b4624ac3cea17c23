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


def test_recorded_labels_are_inert_and_cut_in_the_real_dashboard(tmp_path):
    """A workload label with markup (a stored-XSS attempt) renders as text in headless Chromium: no script runs and
    no element is made from it; a 10,000-character label is cut, not spread across the page."""
    import shutil
    import subprocess
    import sys

    from dspine.process import free_port, wait_http
    from dspine.serve.store import AcceptanceStore

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is needed (.ci/run installs it)"
    db = str(tmp_path / "records.db")
    payload = "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"
    long = "w" * 10_000
    st = AcceptanceStore(db)
    for k, (workload, thinking) in enumerate([(payload, "low"), (long, "<b>high</b>"), ("tool", "low")]):
        st.append(
            RequestRecord(f"r{k}", "m", workload, thinking, drafter="d<script>x()</script>", accept_hist=[2, 1, 1, 0])
        )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspine.cli", "dashboard", "--db", db, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_http(url, proc, 60)
        flags = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-sync",
            "--disable-background-networking",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--virtual-time-budget=6000",
            "--dump-dom",
            url,
        ]
        dom = subprocess.run(flags, capture_output=True, text=True, timeout=120).stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert 'data-rendered="1"' in dom, dom[:2000]
    assert 'data-pwned="1"' not in dom  # the handler never ran (it would have set this attribute on the body)
    from html.parser import HTMLParser

    class Page(HTMLParser):  # the elements the page holds, and the text it shows
        def __init__(self):
            super().__init__()
            self.tags, self.text, self.scripts = set(), [], 0

        def handle_starttag(self, tag, attrs):
            self.tags.add(tag)
            self.scripts += tag == "script"

        def handle_data(self, data):
            self.text.append(data)

    page = Page()
    page.feed(dom)
    text = "".join(page.text)
    assert "img" not in page.tags and "b" not in page.tags and page.scripts == 1  # no element made from a label
    assert '<img src=x onerror="' in text and "<b>high</b>" in text and "d<script>x()</script>" in text
    assert long not in text and "w" * 47 + "…" in text  # cut in the table and legends
