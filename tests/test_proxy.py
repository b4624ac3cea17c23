"""The serving stack as agent frameworks see it: the real `dspine serve` behind the real LiteLLM proxy on
127.0.0.1, requests from the OpenAI client, acceptance recorded once per request (streaming too) with the
workload and thinking level, the key enforced, and the dashboard rendered in headless Chromium."""

import json
import multiprocessing as mp
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from bad_requests import BAD
from conftest import READ_KEY, read_json_url, running_server

from dspine.checkpoint import save_drafter
from dspine.process import free_port, wait_http
from dspine.serve.records import RequestRecord
from dspine.serve.store import AcceptanceStore
from dspine.stats import AcceptanceStats

KEY = "sk-dspine-test-key"
ARTIFACTS = Path(
    os.environ.get("DSPINE_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "runs" / "test-artifacts")
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_drafters):
    from dspine.serve.proxy import Backend, ProxyConfig, start_proxy, stop_proxy

    tmp = tmp_path_factory.mktemp("proxy")
    ckpt = save_drafter(smollm2_drafters["dspine"][1], tmp / "dspine")
    with running_server(ckpt, "smol-backend") as server:
        cfg = ProxyConfig(
            # "down": a backend nothing listens on (its port was free when asked)
            backends=[
                Backend("smol", server + "/v1", "smol-backend"),
                Backend("down", f"http://127.0.0.1:{free_port()}/v1"),
                Backend("smol-office", server + "/v1", "smol-backend"),  # the route target of the routing test
            ],
            routes={"office": "smol-office", "review/high": "smol-office"},
            port=free_port(),
            db=str(tmp / "acceptance.db"),
            metrics_port=free_port(),
            workdir=str(tmp / "litellm"),
            body_timeout_s=3.0,
        )
        with open(tmp / "litellm.log", "w") as log:
            proc = start_proxy(cfg, key=KEY, log=log, read_key=READ_KEY)
        try:
            yield {"server": server, "proxy": f"http://127.0.0.1:{cfg.port}", "cfg": cfg, "tmp": tmp}
        finally:
            stop_proxy(proc)


def _rows(db) -> list[dict]:
    return AcceptanceStore(db).rows()


def _wait_rows(db, n, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        rows = _rows(db)
        if len(rows) >= n:
            return rows
        time.sleep(0.25)
    return _rows(db)


def _server_requests(server) -> float:
    text = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^dspine_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_requests_through_the_proxy_are_recorded_once_with_the_servers_tau(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY)
    sent = {}
    for workload in ("swe", "tool_use"):
        for effort in ("none", "high"):
            for stream in (False, True):
                kw = dict(
                    model="smol",
                    max_tokens=8,
                    temperature=0,
                    reasoning_effort=effort,
                    metadata={"workload": workload},
                    messages=[{"role": "user", "content": f"Name one {workload} tool. ({effort})"}],
                )
                if stream:
                    ids = {c.id for c in client.chat.completions.create(stream=True, **kw)}
                    assert len(ids) == 1
                    rid = ids.pop()
                else:
                    rid = client.chat.completions.create(**kw).id
                sent[rid] = (workload, effort, stream)
    rows = _wait_rows(stack["cfg"].db, len(sent))
    time.sleep(1.0)  # a duplicate callback, if any, would land now
    rows = _rows(stack["cfg"].db)
    assert sorted(r["request_id"] for r in rows) == sorted(sent)  # each request once, nothing else
    cached = 0
    for r in rows:
        workload, effort, stream = sent[r["request_id"]]
        assert (r["workload"], r["thinking"], bool(r["stream"])) == (workload, effort, stream)
        own = read_json_url(f"{stack['server']}/v1/dspine/requests/{r['request_id']}")
        assert own["thinking"] == effort and own["workload"] == workload
        assert r["tau"] == pytest.approx(own["spec"]["spec_accept_length"], abs=1e-12)
        assert r["verify_rounds"] == own["spec"]["spec_verify_ct"]
        assert r["accept_hist"] == own["spec"]["spec_correct_drafts_histogram"]
        assert r["tau"] == AcceptanceStats(len(r["accept_hist"]), r["accept_hist"]).tau
        assert r["completion_tokens"] == own["completion_tokens"] and r["drafter"] == own["drafter"]
        assert r["source"] == "backend_record" and r["model"] == "smol" and r["latency_s"] > 0
        cached += own["cached_tokens"]
    # Prometheus, labelled by workload and thinking level: two requests (stream + not) per cell
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack['cfg'].metrics_port}/metrics", timeout=10).read().decode()
    for workload in ("swe", "tool_use"):
        for effort in ("none", "high"):
            line = re.search(
                rf'^dspine_proxy_requests_total\{{(?=[^}}]*workload="{workload}")'
                rf'(?=[^}}]*thinking="{effort}")[^}}]*\}} (\S+)$',
                text,
                re.M,
            )
            assert line and float(line.group(1)) == 2.0, (workload, effort)
    rounds = sum(r["verify_rounds"] for r in rows)
    got = sum(float(v) for v in re.findall(r"^dspine_proxy_verify_rounds_total\{[^}]*\} (\S+)$", text, re.M))
    assert got == rounds
    # each message went twice (stream and not): the second reused the first's prefill, and the proxy counts it
    got = sum(float(v) for v in re.findall(r"^dspine_proxy_cached_prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M))
    assert got == cached > 0


def test_responses_and_chat_clients_share_the_proxy_with_no_cooldown(stack):
    """The Agents SDK's default model calls /v1/responses: through the proxy it reaches the backend's Responses
    API, beside chat clients at the same time, and is recorded with the backend's τ under the backend's id. An
    endpoint the backend lacks answers 404 and puts nothing in cooldown (every other client would get 429)."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY, max_retries=0)
    lacking = urllib.request.Request(
        stack["proxy"] + "/v1/embeddings",
        json.dumps({"model": "smol", "input": "x"}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(lacking, timeout=60)
    assert e.value.code == 404
    before = len(_rows(stack["cfg"].db))

    def responses(stream: bool):
        kw = dict(model="smol", input="Name a colour.", max_output_tokens=16, temperature=0)
        if stream:
            return list(client.responses.create(stream=True, **kw))[-1].response
        return client.responses.create(**kw)

    def chat(_):
        msgs = [{"role": "user", "content": "Name a colour."}]
        return client.chat.completions.create(model="smol", messages=msgs, max_tokens=16, temperature=0)

    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(responses, False), pool.submit(responses, True), pool.submit(chat, 0), pool.submit(chat, 1)]
        got = [j.result() for j in jobs]  # none raises: no 429, no cooldown
    texts = {r.output_text for r in got[:2]} | {c.choices[0].message.content for c in got[2:]}
    assert len(texts) == 1  # greedy: the same words on both surfaces
    rows = _wait_rows(stack["cfg"].db, before + 4)[before:]
    assert len(rows) == 4 and all(r["tau"] and r["source"] == "backend_record" for r in rows)
    for r in rows:  # each under the backend's own id, whatever id LiteLLM gave the client
        own = read_json_url(f"{stack['server']}/v1/dspine/requests/{r['request_id']}")
        assert r["accept_hist"] == own["spec"]["spec_correct_drafts_histogram"]


def test_a_bom_or_utf16_body_reads_the_same_through_the_proxy(stack):
    """A body with a UTF-8 byte-order mark, or in UTF-16, is JSON the server reads: through the proxy it is read
    alike and answered with the same text (it used to be a 400 there and a 200 from the server)."""
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    texts = set()
    for base, model in ((stack["server"], "smol-backend"), (stack["proxy"], "smol")):
        text = json.dumps({**body, "model": model})
        for raw in (b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16")):
            req = urllib.request.Request(
                base + "/v1/chat/completions",
                raw,
                {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                texts.add(json.loads(r.read())["choices"][0]["message"]["content"])
    assert len(texts) == 1


def test_a_streamed_reply_through_the_proxy_carries_its_usage(stack):
    """The server always ends a stream with its usage; through the proxy it comes too, without stream_options."""
    from openai import OpenAI

    client = OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY)
    kw = dict(model="smol", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kw).usage
    usage = [c.usage for c in client.chat.completions.create(stream=True, **kw) if c.usage]
    assert usage and (usage[-1].prompt_tokens, usage[-1].completion_tokens) == (
        whole.prompt_tokens,
        whole.completion_tokens,
    )


def test_a_body_that_never_arrives_whole_gets_408_from_the_proxy(stack):
    """A Content-Length larger than what is sent holds a proxy connection only until --body-timeout (3 s here)."""
    import socket

    host, port = stack["proxy"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode())
        s.sendall(b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": ')
        t0, raw = time.time(), b""
        while chunk := s.recv(4096):  # the headers and the body may come in separate packets: read the whole body
            raw += chunk
            head, _, body = raw.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.I)
            if length and len(body) >= int(length.group(1)):
                break
        answer = raw.decode()
    assert answer.startswith("HTTP/1.1 408") and "did not arrive within 3 s" in answer, answer
    assert time.time() - t0 < 15
    assert urllib.request.urlopen(stack["proxy"] + "/health/liveliness", timeout=30).status == 200


def test_a_client_that_gives_up_through_the_proxy_aborts_the_backend(stack):
    """A client timeout through the proxy (the OpenAI client's timeout=1, no retries) aborts the backend's decode
    at its next round: the backend's record says abort after a fraction of max_tokens, and the proxy records no
    success. A request's own `timeout` field limits the decode as it does on the server (the backend's record says
    abort)."""
    import openai

    def server_records() -> dict:
        data = read_json_url(stack["server"] + "/v1/dspine/requests?limit=1000")["data"]
        return {r["request_id"]: r for r in data}

    before, rows = server_records(), len(_rows(stack["cfg"].db))
    ask = dict(model="smol", max_tokens=1500, temperature=0, extra_body={"ignore_eos": True})
    msgs = [{"role": "user", "content": "Count from 1 to 1000."}]
    impatient = openai.OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(messages=msgs, **ask)
    deadline, new = time.time() + 60, []
    while not new and time.time() < deadline:
        new = [r for rid, r in server_records().items() if rid not in before]
        time.sleep(0.25)
    assert len(new) == 1 and new[0]["finish_reason"] == "abort" and new[0]["completion_tokens"] < 300, new
    time.sleep(1.0)
    assert len(_rows(stack["cfg"].db)) == rows  # the client got nothing: no success recorded
    patient = openai.OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY, max_retries=0)
    t0 = time.time()
    out = patient.chat.completions.create(messages=msgs, **{**ask, "extra_body": {"ignore_eos": True, "timeout": 1}})
    assert out.usage.completion_tokens < 1500 and time.time() - t0 < 30
    own = server_records()[out.id]  # LiteLLM says "stop" for the backend's "abort"; the record keeps it
    assert own["finish_reason"] == "abort" and own["completion_tokens"] == out.usage.completion_tokens


def test_agent_traffic_through_the_proxy_exports_as_traces(stack, smollm2, tmp_path):
    """Requests with metadata.workload are stored with the backend's exact token ids (streamed ones too) and
    `dspine traces export` turns them into the training format agents/collect write."""
    import datasets
    from openai import OpenAI

    from dspine.agents.traces import SCHEMA
    from dspine.cli import main

    client = OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY)
    sent = {}
    for i, stream in enumerate((False, True)):
        kw = dict(
            model="smol",
            max_tokens=8,
            temperature=0,
            reasoning_effort="low",
            metadata={"workload": "office", "episode_id": "ep-1", "task_id": "t-1"},
            messages=[{"role": "user", "content": f"Say {i} things."}],
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            rid, extra = {c.id for c in chunks}.pop(), [set(c.model_extra or {}) for c in chunks]
            extra += [set(ch.model_extra or {}) for c in chunks for ch in c.choices]
        else:
            reply = client.chat.completions.create(**kw)
            rid, extra = reply.id, [set(reply.model_extra or {}), set(reply.choices[0].model_extra or {})]
        # the proxy keeps the ids in the backend's record (record_token_ids): the reply carries none it did not ask for
        assert not set().union(*extra) & {"prompt_token_ids", "token_ids"}, extra
        sent[rid] = kw["messages"]
    untagged = client.chat.completions.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    rows, deadline = _rows(stack["cfg"].db), time.time() + 60
    while not {untagged.id, *sent} <= {r["request_id"] for r in rows} and time.time() < deadline:
        time.sleep(0.25)
        rows = _rows(stack["cfg"].db)
    traced = {t["request_id"] for t in AcceptanceStore(stack["cfg"].db).traces()}
    assert set(sent) <= traced and untagged.id not in traced
    assert main(["traces", "export", "--from-store", stack["cfg"].db, "--out", str(tmp_path / "t")]) == 0
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "t/traces/*/*.parquet"), split="train")
    assert set(ds.column_names) == set(SCHEMA.names)
    mine = [r for r in ds if r["request_id"] in sent]
    assert len(mine) == 2 and {r["turn"] for r in mine} == {0, 1} and all(r["episode_id"] == "ep-1" for r in mine)
    for r in mine:
        own = read_json_url(f"{stack['server']}/v1/dspine/requests/{r['request_id']}")
        assert (
            r["prompt_token_ids"] == own["prompt_token_ids"]
            and smollm2.decode(r["completion_token_ids"]) == own["text"]
        )
        assert (
            json.loads(r["messages"]) == sent[r["request_id"]] and r["workload"] == "office" and r["task_id"] == "t-1"
        )
        assert r["accept_hist"] == own["spec"]["spec_correct_drafts_histogram"] and r["thinking"] == "low"


def test_an_agents_call_through_the_proxy_keeps_its_ids_and_acceptance(stack, smollm2, tmp_path):
    """An agent harness's model call (LiteLLM's SDK, as collect.py runs it) through the proxy: the per-choice
    ids and acceptance, which the SDK drops from a proxy's reply, reach the trace row at the top level, equal to
    the server's own record; a client that asks for nothing gets none of them."""
    from openai import OpenAI

    from dspine.agents.base import AgentConfig, Episode, Task

    cfg = AgentConfig(endpoint=stack["proxy"] + "/v1", model="smol", api_key=KEY, max_tokens=12)
    ep = Episode(cfg, Task("t-9", "tool", "Say hi."), "low", "ep-9", tmp_path / "ep", {})
    resp = ep.chat([{"role": "user", "content": "Name three colours."}])
    row = ep.rows[-1]
    own = read_json_url(f"{stack['server']}/v1/dspine/requests/{resp.id}")
    assert row.has_token_ids and row.prompt_token_ids == own["prompt_token_ids"]
    assert smollm2.decode(row.completion_token_ids) == own["text"] == resp.choices[0].message.content
    assert row.accept_hist == own["spec"]["spec_correct_drafts_histogram"] and row.tau == pytest.approx(own["tau"])
    plain = OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY).chat.completions.create(
        model="smol", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    )
    assert not set(plain.model_extra or {}) & {"prompt_token_ids", "completion_token_ids", "meta_info"}


def test_proxy_fails_fast_on_a_busy_port_and_its_child_dies_with_it(stack, tmp_path):
    import socket

    def cli(port):
        return [
            sys.executable,
            "-m",
            "dspine.cli",
            "proxy",
            "--backend",
            f"smol={stack['server']}/v1@smol-backend",
            "--port",
            str(port),
            "--db",
            str(tmp_path / "a.db"),
            "--workdir",
            str(tmp_path / "w"),
        ]

    env = {**os.environ, "DSPINE_PROXY_KEY": KEY}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        t0 = time.time()
        r = subprocess.run(cli(busy.getsockname()[1]), env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "is busy" in r.stderr and time.time() - t0 < 60, r.stderr
    port = free_port()
    parent = subprocess.Popen(cli(port), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health/liveliness", parent, 180)
        parent.kill()  # SIGKILL: no cleanup code runs in dspine proxy
        parent.wait()
        deadline, alive = time.time() + 30, True
        while alive and time.time() < deadline:
            with socket.socket() as s:
                alive = s.connect_ex(("127.0.0.1", port)) == 0
            time.sleep(0.5)
        assert not alive, "LiteLLM kept serving after dspine proxy was killed"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_proxy_refuses_a_missing_or_wrong_key(stack):
    from openai import AuthenticationError, OpenAI

    before_rows, before_server = len(_rows(stack["cfg"].db)), _server_requests(stack["server"])
    for key in ("sk-wrong", "none"):
        with pytest.raises(AuthenticationError) as e:
            OpenAI(base_url=stack["proxy"] + "/v1", api_key=key, max_retries=0).chat.completions.create(
                model="smol", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        assert e.value.status_code == 401 and "key" in str(e.value)
    req = urllib.request.Request(
        stack["proxy"] + "/v1/chat/completions",
        json.dumps({"model": "smol", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
    # LiteLLM's routes that would skip the gate (the model in the path) and its admin UI: closed, key or not
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    for method, path in (
        ("POST", "/openai/deployments/smol/chat/completions?api-version=2024-06-01"),
        ("POST", "/engines/smol/chat/completions"),
        ("GET", "/ui"),
        ("GET", "/ui/"),
    ):
        req = urllib.request.Request(
            stack["proxy"] + path,
            body if method == "POST" else None,
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
            method=method,
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 404 and "not served by dspine proxy" in e.value.read().decode(), path
    time.sleep(1.0)
    assert len(_rows(stack["cfg"].db)) == before_rows and _server_requests(stack["server"]) == before_server


def test_dashboard_renders_the_recorded_data_in_chromium(stack):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is needed (.ci/run installs it)"
    db = stack["cfg"].db
    rows = _wait_rows(db, 8)
    assert len(rows) >= 8, "the proxy test records the data this test draws"
    summary = AcceptanceStore(db).summary()
    # the adaptation loop's folder as adapt/cycle.py and adapt/deployment.py write it: a skipped iteration, then
    # one adapted whose drafter was deployed; the history holds an earlier refusal too
    loop = stack["tmp"] / "loop"
    loop.mkdir()
    cells = {"tool/low": (1.73, 2.41), "tool/high": (1.70, 2.02), "swe/low": (1.52, 1.98)}
    per_cell = {c: {"base": b, "adapted": a, "ratio": a / b} for c, (b, a) in cells.items()}
    deploys = [
        {
            "ts": 1.7e9,
            "group": "all",
            "drafter": "loop/iter-000/finetune/all",
            "action": "refused",
            "reasons": ["office/high: τ ratio 0.984 < 1.0"],
            "gated_tau": 2.0,
        },
        {
            "ts": 1.7e9 + 600,
            "group": "all",
            "drafter": "loop/iter-002/finetune/all",
            "action": "deployed",
            "live": {"tau": 2.31, "requests": 4},
            "gated_tau": 2.2,
            "reasons": None,
        },
    ]
    iterations = [
        {
            "iteration": 0,
            "action": "adapted",
            "per_cell": {"tool/low": {"base": 1.7, "adapted": 1.6, "ratio": 0.94}},
            "general_regression": 0.03,
            "deploys": [{"group": "all", "action": "refused"}],
        },
        {"iteration": 1, "action": "skipped", "reason": "3 new trace rows < min_rows 8"},
        {
            "iteration": 2,
            "action": "adapted",
            "per_cell": per_cell,
            "general_regression": 0.004,
            "deploys": [{"group": "all", "action": "deployed"}],
        },
    ]
    (loop / "loop.json").write_text(json.dumps(iterations))
    (loop / "deploys.jsonl").write_text("".join(json.dumps(d) + "\n" for d in deploys))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspine.cli", "dashboard", "--db", db, "--port", str(port), "--loop", str(loop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_http(url, proc, 60)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        flags = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={stack['tmp'] / 'chromium'}",
            "--virtual-time-budget=8000",
            "--window-size=1240,1000",
        ]
        dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        shot = ARTIFACTS / "dashboard.png"
        subprocess.run(flags + [f"--screenshot={shot}", url], capture_output=True, timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert 'data-rendered="1"' in dom, dom[:2000]
    assert (
        re.search(rf'id="status"[^>]*data-requests="{summary["requests"]}"', dom)
        or f'data-requests="{summary["requests"]}"' in dom
    )
    bars = {
        (m.group(1), m.group(2)): float(m.group(3))
        for m in re.finditer(
            r'<rect[^>]*class="tau-bar"[^>]*data-workload="([^"]+)"[^>]*data-thinking="([^"]+)"[^>]*data-tau="([^"]+)"',
            dom,
        )
    }
    want = {(c["workload"], c["thinking"]): c["tau_mean"] for c in summary["cells"] if c["tau_mean"] is not None}
    assert set(bars) == set(want) and len(want) >= 4  # the 2 × 2 cells of the first test, and any later ones
    for k, v in want.items():
        assert bars[k] == pytest.approx(v, abs=1e-4)
    level_colors = {"none": "#bab0ac", "low": "#4e79a7", "medium": "#59a14f", "high": "#f28e2b", "xhigh": "#e15759"}
    fills = re.findall(r'<rect[^>]*fill="(#[0-9a-f]{6})"[^>]*class="tau-bar"[^>]*data-thinking="([^"]+)"', dom)
    assert fills and all(level_colors[t] == f for f, t in fills if t in level_colors), fills  # fixed per level
    curves = re.findall(r'<polyline[^>]*class="slot-curve"[^>]*data-per-slot="([^"]+)"', dom)
    assert len(curves) == len(summary["cells"])
    assert sorted(tuple(round(float(x), 4) for x in c.split()) for c in curves) == sorted(
        tuple(round(p, 4) for p in c["per_slot"]) for c in summary["cells"]
    )
    assert len(re.findall(r'class="rps-point"', dom)) == len(summary["series"]) >= 1
    # the adaptation card: the latest adapted iteration's cells, base and adapted side by side, and every deploy
    adapt = {
        (m.group(1), m.group(2)): float(m.group(3))
        for m in re.finditer(r'class="adapt-bar" data-cell="([^"]+)" data-kind="([^"]+)" data-tau="([^"]+)"', dom)
    }
    want = {(c, k): v[k] for c, v in per_cell.items() for k in ("base", "adapted")}
    assert adapt.keys() == want.keys() and all(adapt[k] == pytest.approx(v, abs=1e-4) for k, v in want.items())
    assert re.findall(r'class="deploy-row" data-group="all" data-action="([a-z_]+)"', dom) == ["refused", "deployed"]
    assert "iteration 2, general regression 0.4%" in dom and "τ ratio 0.984 &lt; 1.0" in dom
    assert shot.is_file() and shot.stat().st_size > 10_000  # the screenshot, kept as a test artifact


def _writer(db, start):
    store = AcceptanceStore(db)
    for i in range(start, start + 50):
        store.append(
            RequestRecord(
                request_id=f"r{i}", model="m", workload="w", thinking="none", stream=False, accept_hist=[1, 2, 3, 0]
            )
        )


def test_store_is_append_only_and_safe_under_concurrent_writers(tmp_path):
    db = str(tmp_path / "s.db")
    AcceptanceStore(db)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(db, s)) for s in (0, 50, 100, 25)]  # the last overlaps two others
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    rows = AcceptanceStore(db).rows()
    assert sorted(r["request_id"] for r in rows) == sorted(f"r{i}" for i in range(150))
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        sqlite3.connect(db).execute("DELETE FROM requests")
    s = AcceptanceStore(db).summary()
    assert s["cells"][0]["requests"] == 150
    assert s["cells"][0]["tau_pooled"] == pytest.approx(AcceptanceStats(4, [150, 300, 450, 0]).tau)


def test_store_summary_orders_levels_fills_gaps_and_splits_drafters(tmp_path):
    """Levels in their own order (unknown ones after, by name), one cell per drafter, and a time series of
    equal buckets from the first request to the last with the idle ones present (0 requests, τ None)."""
    store = AcceptanceStore(str(tmp_path / "s.db"))
    for i, (d, t, ts) in enumerate(
        [
            ("a", "high", 1000.0),
            ("a", "low", 1000.0),
            ("a", "none", 1005.0),
            ("b", "low", 1400.0),
            ("a", "zeta", 1400.0),
        ]
    ):
        store.append(
            RequestRecord(
                request_id=f"r{i}",
                model="m",
                drafter=d,
                workload="w",
                thinking=t,
                stream=False,
                accept_hist=[1, 1],
                ts=ts,
            )
        )
    s = store.summary(bucket_s=60)
    assert [(c["drafter"], c["thinking"]) for c in s["cells"]] == [
        ("a", "none"),
        ("a", "low"),
        ("a", "high"),
        ("a", "zeta"),
        ("b", "low"),
    ]
    assert [x["t"] for x in s["series"]] == [960 + 60 * i for i in range(8)]
    assert [x["requests"] for x in s["series"]] == [3, 0, 0, 0, 0, 0, 0, 2]
    assert [x["tau_mean"] is None for x in s["series"]] == [False] + [True] * 6 + [False]
    wide = store.summary(bucket_s=60, max_points=4)
    assert wide["bucket_s"] == 120 and [x["requests"] for x in wide["series"]] == [3, 0, 0, 2]


@pytest.mark.parametrize("name,body,raw,status,needle,ctype,path", BAD, ids=[b[0] for b in BAD])
def test_bad_input_through_the_proxy_gets_the_servers_4xx(stack, name, body, raw, status, needle, ctype, path):
    """The server's bad-input table sent through the proxy: the same status and words (LiteLLM never answers
    500 or a misleading message), nothing recorded, both processes alive."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(stack["proxy"] + path, data, {"Content-Type": ctype, "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    text = e.value.read().decode()
    assert e.value.code == status, text
    assert needle in json.loads(text)["error"]["message"], text
    assert urllib.request.urlopen(stack["proxy"] + "/health/liveliness", timeout=30).status == 200
    assert json.loads(urllib.request.urlopen(stack["server"] + "/health", timeout=30).read())["status"] == "ok"


def test_a_down_backend_is_503_and_an_abandoned_stream_is_recorded_with_its_tau(stack):
    import httpx

    before = {r["request_id"] for r in _rows(stack["cfg"].db)}
    body = {"model": "down", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        stack["proxy"] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert r.status_code == 503 and "cannot be reached" in r.json()["error"]["message"], r.text

    long = {
        "model": "smol",
        "stream": True,
        "max_tokens": 150,
        "temperature": 0,
        "metadata": {"workload": "gone"},
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
    }
    with httpx.stream(
        "POST",
        stack["proxy"] + "/v1/chat/completions",
        json=long,
        timeout=120,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                rid, events = json.loads(line[6:])["id"], events + 1
            if events == 3:
                break  # the client hangs up
    deadline = time.time() + 60
    while time.time() < deadline and not [x for x in _rows(stack["cfg"].db) if x["request_id"] == rid]:
        time.sleep(0.25)
    rows = [x for x in _rows(stack["cfg"].db) if x["request_id"] not in before]
    assert [x["request_id"] for x in rows] == [rid]  # the 503 is not a record; the abandoned stream is
    own = read_json_url(f"{stack['server']}/v1/dspine/requests/{rid}")
    assert own["finish_reason"] == "abort" and 0 < own["completion_tokens"] < 150
    row = rows[0]
    assert row["source"] == "backend_record" and row["workload"] == "gone"
    assert row["tau"] == pytest.approx(own["tau"]) and row["verify_rounds"] == own["verify_rounds"] >= 1
    assert row["completion_tokens"] == own["completion_tokens"] and row["prompt_tokens"] == own["prompt_tokens"]
    deadline = time.time() + 30  # and the server gave its place back
    while time.time() < deadline and json.loads(urllib.request.urlopen(stack["server"] + "/health").read())["admitted"]:
        time.sleep(0.25)
    assert json.loads(urllib.request.urlopen(stack["server"] + "/health").read())["admitted"] == 0


def test_routes_send_a_workload_to_its_backend(stack):
    """--route WORKLOAD[/LEVEL]=BACKEND: a request of that workload (and level) reaches that backend whatever model
    it named, the others the model they named; a route to an unknown backend or of a bad shape is refused."""
    from openai import OpenAI

    from dspine.config import ConfigError
    from dspine.serve.proxy import Backend, ProxyConfig, parse_route

    client = OpenAI(base_url=stack["proxy"] + "/v1", api_key=KEY)

    def ask(workload, effort):
        msg = [{"role": "user", "content": f"One word for {workload}."}]
        return client.chat.completions.create(
            model="smol",
            max_tokens=4,
            temperature=0,
            reasoning_effort=effort,
            metadata={"workload": workload},
            messages=msg,
        ).id

    sent = {
        ask("office", "none"): "smol-office",
        ask("office", "high"): "smol-office",
        ask("review", "high"): "smol-office",
        ask("review", "low"): "smol",
        ask("swe", "none"): "smol",
    }
    deadline = time.time() + 60
    while time.time() < deadline and not set(sent) <= {r["request_id"] for r in _rows(stack["cfg"].db)}:
        time.sleep(0.25)
    got = {r["request_id"]: r["model"] for r in _rows(stack["cfg"].db) if r["request_id"] in sent}
    assert got == sent
    back = [Backend("smol", "http://127.0.0.1:1/v1")]
    for routes, needle in (({"tool": "nope"}, "names backend 'nope'"), ({"tool/loud": "smol"}, "not WORKLOAD")):
        with pytest.raises(ConfigError, match=needle):
            ProxyConfig(backends=back, routes=routes).validate()
    assert parse_route("swe/high=smol") == ("swe/high", "smol")
    with pytest.raises(ConfigError, match="WORKLOAD"):
        parse_route("swe")


def test_a_port_left_in_time_wait_is_free_for_a_restart():
    """A proxy stopped with connections open leaves its port in TIME_WAIT: a restart on the same port is allowed
    (as uvicorn binds it, SO_REUSEADDR); a port someone listens on is still busy."""
    import socket

    from dspine.config import ConfigError
    from dspine.serve.proxy import check_port_free

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server's side closes first: its port goes to TIME_WAIT
    time.sleep(0.2)
    client.close()
    srv.close()
    with socket.socket() as plain:  # what the old check did: refused
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    check_port_free("127.0.0.1", port, "port")
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(ConfigError, match="is busy"):
            check_port_free("127.0.0.1", port, "port")


def test_sigterm_of_the_proxy_during_streams_keeps_every_row_and_a_restart_takes_the_port(stack, tmp_path):
    """SIGTERM while four streams decode: a new request meanwhile gets 503 with Retry-After (the port stays open),
    the streams finish, every one is recorded before the proxy exits, and a proxy started again at once on the same
    port comes up (the old one's connections are in TIME_WAIT); a kill -9 of it after a request leaves that
    request's row in an intact store."""
    import signal
    import threading

    import openai
    from openai import OpenAI

    from dspine.serve.proxy import Backend, ProxyConfig, start_proxy, stop_proxy

    cfg = ProxyConfig(
        backends=[Backend("smol", stack["server"] + "/v1", "smol-backend")],
        port=free_port(),
        db=str(tmp_path / "drain.db"),
        workdir=str(tmp_path / "litellm"),
    )
    proc = start_proxy(cfg, key=KEY, log=open(tmp_path / "proxy.log", "w"), read_key=READ_KEY)
    client = OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key=KEY, max_retries=0)
    started, ended = [], []

    def stream(i):
        msgs = [{"role": "user", "content": f"Count from {i} to {i + 40}."}]
        chunks = client.chat.completions.create(model="smol", messages=msgs, max_tokens=40, temperature=0, stream=True)
        for k, c in enumerate(chunks):
            if k == 0:
                started.append(c.id)
        ended.append(i)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while len(started) < 4 and time.time() < deadline:
            time.sleep(0.05)
        assert len(started) == 4
        os.killpg(proc.pid, signal.SIGTERM)  # what stop_proxy sends first
        time.sleep(0.5)
        with pytest.raises(openai.APIStatusError) as late:  # a request after it: told to retry, not refused
            client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert late.value.status_code == 503 and late.value.response.headers.get("retry-after") == "5"
        assert proc.poll() is None and len(ended) < 4  # still draining
        assert stop_proxy(proc, timeout=120) is not None  # waits for it to exit
        for t in threads:
            t.join(120)
        assert sorted(ended) == [0, 1, 2, 3]
        assert sorted(r["request_id"] for r in AcceptanceStore(cfg.db).rows()) == sorted(started)
        proc = start_proxy(cfg, key=KEY, log=open(tmp_path / "proxy2.log", "w"), read_key=READ_KEY)  # same port
        again = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert again.id in {r["request_id"] for r in _wait_rows(cfg.db, 5)}
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9 between requests: what the store wrote stays, readable
        proc.wait(30)
        with sqlite3.connect(cfg.db) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert {r["request_id"] for r in AcceptanceStore(cfg.db).rows()} == {*started, again.id}
    finally:
        stop_proxy(proc)


def _record_of(base: str, rid: str) -> dict | None:
    """A dspine serve backend's own record of request `rid`, or None where it has none."""
    try:
        return read_json_url(f"{base}/v1/dspine/requests/{rid}")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def test_replicas_of_one_name_share_its_traffic_and_each_request_is_read_from_the_one_that_served_it(
    stack, smollm2_drafters
):
    """--backend NAME=URL twice (distinct URLs): one model, two `dspine serve` replicas; concurrent requests spread
    over both, and each stored row carries the acceptance of the replica that answered it (its own record, asked
    from that replica); the same name and URL twice is refused."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from dspine.config import ConfigError
    from dspine.serve.proxy import Backend, ProxyConfig, start_proxy, stop_proxy

    tmp = stack["tmp"]
    ckpt = save_drafter(smollm2_drafters["dspine"][0], tmp / "replica")  # another drafter: its own τ and name
    with running_server(ckpt, "smol-backend") as second:
        servers = (stack["server"], second)
        cfg = ProxyConfig(
            backends=[Backend("pair", s + "/v1", "smol-backend") for s in servers],
            port=free_port(),
            db=str(tmp / "replicas.db"),
            workdir=str(tmp / "litellm-replicas"),
        )
        with open(tmp / "replicas.log", "w") as log:
            proc = start_proxy(cfg, key=KEY, log=log, read_key=READ_KEY)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key=KEY)

            def ask(i):
                msg = [{"role": "user", "content": f"Count to {i}."}]
                kw = dict(model="pair", max_tokens=6, temperature=0, messages=msg, metadata={"workload": "replicas"})
                return client.chat.completions.create(**kw).id

            with ThreadPoolExecutor(4) as ex:
                sent = list(ex.map(ask, range(16)))
            rows = _wait_rows(cfg.db, len(sent))
            assert sorted(r["request_id"] for r in rows) == sorted(sent)
            served = {s: 0 for s in servers}
            for r in rows:
                records = {s: _record_of(s, r["request_id"]) for s in servers}
                (owner,) = [s for s, rec in records.items() if rec is not None]
                own = records[owner]
                served[owner] += 1
                assert r["source"] == "backend_record" and r["model"] == "pair" and r["workload"] == "replicas"
                assert (
                    r["drafter"] == own["drafter"] and r["accept_hist"] == own["spec"]["spec_correct_drafts_histogram"]
                )
            # 16 requests at random over two replicas: all on one has probability 2 / 2**16
            assert min(served.values()) >= 1, served
        finally:
            stop_proxy(proc)
    with pytest.raises(ConfigError, match="given twice"):
        ProxyConfig(backends=[Backend("a", "http://127.0.0.1:9/v1"), Backend("a", "http://127.0.0.1:9/v1/")]).validate()
