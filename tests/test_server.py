"""The real `dspine serve` process on 127.0.0.1: OpenAI shapes, SGLang's acceptance fields, streaming,
records and metrics, and one clear 4xx per kind of bad input with the server staying up."""

import json
import time
import urllib.error
import urllib.request

import pytest
from bad_requests import BAD, CHAT
from conftest import READ_KEY, running_server

from dspine.checkpoint import save_drafter
from dspine.engine import Engine
from dspine.sampling import SamplingParams


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_drafters):
    ckpt = save_drafter(smollm2_drafters["dspine"][1], tmp_path_factory.mktemp("srv") / "dspine")
    with running_server(ckpt, "smol") as base:
        yield base


def post(base, path, body, raw=None, ctype="application/json"):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def get(base, path):
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {READ_KEY}"})  # records need it
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def test_chat_returns_acceptance_in_sglang_shape(server, smollm2):
    status, body, headers = post(
        server,
        "/v1/chat/completions",
        {
            **CHAT,
            "return_spec_tokens_details": True,
            "return_meta_info": True,
            "metadata": {"workload": "swe"},
            "reasoning_effort": "none",
        },
    )
    assert status == 200, body
    j = json.loads(body)
    assert j["object"] == "chat.completion" and j["choices"][0]["message"]["role"] == "assistant"
    spec = j["sglext"]["spec_tokens_details"]
    assert 1.0 <= spec["spec_accept_length"] <= 16 and spec["spec_verify_ct"] >= 1
    for k in (
        "spec_accept_rate",
        "spec_num_correct_drafts",
        "spec_num_proposed_drafts",
        "spec_correct_drafts_histogram",
    ):
        assert k in spec and k in j["meta_info"]
    assert spec["spec_num_proposed_drafts"] == 15 * spec["spec_verify_ct"]
    # lossless through the server: greedy text equals the target alone
    want = Engine(smollm2).generate(CHAT["messages"], SamplingParams(max_tokens=24))
    assert j["choices"][0]["message"]["content"] == want.text
    rec = json.loads(get(server, f"/v1/dspine/requests/{j['id']}"))
    assert rec["workload"] == "swe" and rec["thinking"] == "none" and rec["spec"] == spec
    assert headers["x-dspine-request-id"] == j["id"]


def test_records_and_drafter_reads_need_the_read_key(server):
    """The records hold completions and token ids: without the read key (or with a wrong one) 401, named."""
    for path in ("/v1/dspine/requests", "/v1/dspine/requests/nope", "/v1/dspine/drafter"):
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": READ_KEY}):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(server + path, headers=auth), timeout=30)
            assert refused.value.code == 401 and "read key" in json.loads(refused.value.read())["error"]["message"]
    assert "data" in json.loads(get(server, "/v1/dspine/requests"))
    assert json.loads(get(server, "/v1/dspine/drafter"))["drafter"].endswith("/dspine")


def test_streaming_matches_non_streaming(server):
    _, body, _ = post(server, "/v1/chat/completions", CHAT)
    full = json.loads(body)["choices"][0]["message"]["content"]
    status, body, headers = post(
        server, "/v1/chat/completions", {**CHAT, "stream": True, "return_spec_tokens_details": True}
    )
    assert status == 200
    events = [
        json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert body.rstrip().endswith("data: [DONE]") and len(events) >= 2
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == full
    last = events[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and "usage" in last
    rec = json.loads(get(server, f"/v1/dspine/requests/{headers['x-dspine-request-id']}"))
    assert rec["spec"] == last["sglext"]["spec_tokens_details"]


def test_token_ids_on_request(server, smollm2):
    """return_token_ids: the exact ids the target saw and produced, whole and streamed, and in the record."""
    _, body, _ = post(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True})
    j = json.loads(body)
    assert j["prompt_token_ids"] == smollm2.chat_ids(CHAT["messages"])
    ids = j["choices"][0]["token_ids"]
    assert len(ids) == j["usage"]["completion_tokens"] and smollm2.decode(ids) == j["choices"][0]["message"]["content"]
    rec = json.loads(get(server, f"/v1/dspine/requests/{j['id']}"))
    assert rec["prompt_token_ids"] == j["prompt_token_ids"] and rec["completion_token_ids"] == ids
    _, body, _ = post(server, "/v1/chat/completions", {**CHAT, "stream": True, "return_token_ids": True})
    events = [json.loads(x[6:]) for x in body.splitlines() if x.startswith("data: {")]
    assert events[-1]["choices"][0]["token_ids"] == ids and events[-1]["prompt_token_ids"] == j["prompt_token_ids"]
    assert all("token_ids" not in e["choices"][0] for e in events[:-1])
    _, plain, _ = post(server, "/v1/chat/completions", CHAT)
    assert "token_ids" not in plain


def test_streaming_with_stop_string(server):
    body = {**CHAT, "max_tokens": 40, "stop": [","]}
    _, full, _ = post(server, "/v1/chat/completions", body)
    full = json.loads(full)["choices"][0]
    _, streamed, _ = post(server, "/v1/chat/completions", {**body, "stream": True})
    events = [
        json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert full["finish_reason"] == "stop" and "," not in full["message"]["content"]
    assert text == full["message"]["content"] and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_models_metrics_and_effort(server):
    status, body, _ = post(
        server, "/v1/completions", {"model": "smol", "prompt": "The sky is", "max_tokens": 8, "temperature": 0}
    )
    assert status == 200 and json.loads(body)["object"] == "text_completion"
    models = json.loads(get(server, "/v1/models"))
    assert models["data"][0]["id"] == "smol" and models["data"][0]["method"] == "dspine"
    assert models["data"][0]["max_model_len"] == 8192
    assert models["data"][0]["reasoning_effort"]["mode"] == "system_note"  # SmolLM2 has no thinking mode: said
    _, b_none, _ = post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "reasoning_effort": "none"})
    _, b_high, _ = post(
        server,
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 2, "reasoning_effort": "high", "metadata": {"workload": "office"}},
    )
    high = json.loads(b_high)
    assert high["usage"]["prompt_tokens"] > json.loads(b_none)["usage"]["prompt_tokens"]  # the budget instruction
    assert json.loads(get(server, f"/v1/dspine/requests/{high['id']}"))["thinking"] == "high"
    status, b_min, _ = post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "reasoning_effort": "minimal"})
    assert (
        status == 200
        and json.loads(get(server, f"/v1/dspine/requests/{json.loads(b_min)['id']}"))["thinking"] == "minimal"
    )
    metrics = get(server, "/metrics")
    assert 'dspine_requests_total{method="dspine",thinking="high",workload="office"} 1.0' in metrics
    assert "dspine_accept_length_bucket" in metrics


def test_a_completions_prompt_may_be_token_ids_or_a_list_of_one(server, smollm2):
    """As OpenAI and SGLang take it: the prompt's token ids, or a list holding one prompt, decode as the text."""
    text = "The capital of France is"
    got = []
    for prompt in (text, smollm2.encode(text), [text], [smollm2.encode(text)]):
        status, body, _ = post(
            server, "/v1/completions", {"model": "smol", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        )
        assert status == 200, body
        doc = json.loads(body)
        got.append((doc["choices"][0]["text"], doc["usage"]["prompt_tokens"]))
    assert len(set(got)) == 1 and got[0][1] == len(smollm2.encode(text))


def test_a_requests_time_limit_aborts_it_and_keeps_its_record(server):
    t0 = time.time()
    status, text, _ = post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 1500, "timeout": 2})
    doc = json.loads(text)
    assert status == 200 and doc["choices"][0]["finish_reason"] == "abort" and time.time() - t0 < 30
    rec = json.loads(get(server, f"/v1/dspine/requests/{doc['id']}"))
    assert rec["finish_reason"] == "abort" and 0 < rec["completion_tokens"] < 1500 and rec["latency_s"] >= 2


@pytest.mark.parametrize("name,body,raw,status,needle,ctype,path", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_and_server_stays_up(server, name, body, raw, status, needle, ctype, path):
    got, text, _ = post(server, path, body, raw, ctype)
    assert got == status, text
    err = json.loads(text)["error"]
    assert needle in err["message"] and err["type"]
    assert json.loads(get(server, "/health"))["status"] == "ok"


def test_a_long_body_is_tokenized_off_the_event_loop(server):
    """A 5 MB prompt (under the body limit, over the prompt limit) is read and tokenized in the parser's thread:
    /health answers throughout, and the prompt is refused by its length."""
    import threading

    big = {**CHAT, "messages": [{"role": "user", "content": "word " * 1_000_000}]}
    got = {}
    sender = threading.Thread(target=lambda: got.update(r=post(server, "/v1/chat/completions", big)))
    sender.start()
    worst, polls = 0.0, 0
    while sender.is_alive():
        t0 = time.time()
        assert json.loads(get(server, "/health"))["status"] == "ok"
        worst, polls = max(worst, time.time() - t0), polls + 1
        time.sleep(0.05)
    sender.join()
    status, text, _ = got["r"]
    assert status == 400 and "at most 200" in text, text
    assert polls >= 3 and worst < 1.0, (polls, worst)


def test_concurrent_requests_are_batched_and_equal_ar(server, smollm2, smollm2_drafters):
    """Requests arriving while the engine is busy are decoded together; each still equals its AR output."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["Name three colours.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]
    busy = {**CHAT, "max_tokens": 48, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    with ThreadPoolExecutor(5) as ex:
        first = ex.submit(post, server, "/v1/chat/completions", busy)

        time.sleep(1.0)  # the first request is decoding; the next four queue behind it
        rest = list(
            ex.map(
                lambda p: post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": p}]}),
                prompts,
            )
        )
    assert first.result()[0] == 200
    ar = Engine(smollm2)
    sizes = []
    for p, (status, body, _) in zip(prompts, rest):
        assert status == 200
        doc = json.loads(body)
        want = ar.generate([{"role": "user", "content": p}], SamplingParams(max_tokens=24))
        assert doc["choices"][0]["message"]["content"] == want.text
        rec = json.loads(get(server, f"/v1/dspine/requests/{doc['id']}"))
        sizes.append(rec["batch_size"])
    assert max(sizes) > 1, sizes


def test_n_logprobs_and_penalties_are_honoured(server, smollm2):
    """Through the real server (decoding with a drafter): n = 2 greedy choices each equal AR; logprobs equal a
    full forward of the prompt and output; presence/frequency penalties give AR's output under the same
    penalties (and change it); ignore_eos decodes past the end; n = 2 streamed (seeded sampling) gives the
    choices the non-streamed request gives, each with its finish."""
    import torch

    from dspine.engine import generate_batch

    body = {**CHAT, "max_tokens": 16, "n": 2, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    status, text, _ = post(server, "/v1/chat/completions", body)
    doc = json.loads(text)
    assert status == 200 and [c["index"] for c in doc["choices"]] == [0, 1], text
    ar = Engine(smollm2).generate(CHAT["messages"], SamplingParams(max_tokens=16))
    for c in doc["choices"]:
        assert c["message"]["content"] == ar.text and c["token_ids"] == ar.token_ids
    assert doc["usage"]["completion_tokens"] == 2 * len(ar.token_ids)
    prompt = doc["prompt_token_ids"]
    logits, _ = smollm2.forward(torch.tensor([prompt + ar.token_ids]))
    lsm = logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    content = doc["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ar.token_ids)
    for j, (tok, item) in enumerate(zip(ar.token_ids, content)):
        assert item["logprob"] == pytest.approx(float(lsm[j, tok]), abs=2e-3) and item["token"] == smollm2.decode([tok])
        top = item["top_logprobs"]
        assert [t["logprob"] for t in top] == pytest.approx(lsm[j].topk(2).values.tolist(), abs=2e-3)

    pen = dict(frequency_penalty=1.2, presence_penalty=0.4)
    got = json.loads(post(server, "/v1/chat/completions", {**CHAT, **pen})[1])["choices"][0]["message"]["content"]
    want = generate_batch(Engine(smollm2), [CHAT["messages"]], SamplingParams(max_tokens=24, **pen))[0].text
    assert got == want and want != Engine(smollm2).generate(CHAT["messages"], SamplingParams(max_tokens=24)).text

    short = {**CHAT, "max_tokens": 64, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    ends = [
        json.loads(post(server, "/v1/chat/completions", {**short, **kw})[1])["choices"][0]
        for kw in ({}, {"ignore_eos": True})
    ]
    assert ends[0]["finish_reason"] == "stop" and ends[1]["finish_reason"] == "length"  # ignore_eos decodes on

    sampled = {**CHAT, "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 7}
    whole = [c["message"]["content"] for c in json.loads(post(server, "/v1/chat/completions", sampled)[1])["choices"]]
    status, text, _ = post(server, "/v1/chat/completions", {**sampled, "stream": True})
    streamed, finish = ["", ""], [None, None]
    for line in text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                streamed[c["index"]] += c["delta"].get("content") or ""
                finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    assert status == 200 and streamed == whole and None not in finish and text.rstrip().endswith("data: [DONE]")


# small: the shared server refuses prompts over 200 tokens; the follow-up carries the schema, call and result
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def test_tool_calling_conversation_through_an_openai_client(server, smollm2, smollm2_drafters):
    """What agent frameworks send: tools, then the assistant's tool_calls (content null) and the tool's result,
    non-streaming and streaming; the reply equals the target's own AR decode of the rendered prompt."""
    from openai import OpenAI

    from dspine.serve.protocol import parse_request, template_messages

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    ask = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]
    first = client.chat.completions.create(model="smol", messages=ask, tools=[WEATHER], max_tokens=24, temperature=0)
    plain = client.chat.completions.create(model="smol", messages=ask, max_tokens=24, temperature=0)
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool schema is in the prompt
    body = {"messages": ask, "tools": [WEATHER]}
    want = Engine(smollm2).generate(
        smollm2.chat_ids(template_messages(parse_request(body, True), False)[0]), SamplingParams(max_tokens=24)
    )
    msg = first.choices[0].message
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if msg.tool_calls:  # a weak target rarely calls; either way the text is the target's own
        assert first.choices[0].finish_reason == "tool_calls"
    else:
        assert msg.content == want.text

    follow = ask + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    kw = dict(model="smol", messages=follow, tools=[WEATHER], max_tokens=16, temperature=0)
    done = client.chat.completions.create(**kw)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    want = Engine(smollm2).generate(
        smollm2.chat_ids(template_messages(parse_request({"messages": follow, "tools": [WEATHER]}, True), False)[0]),
        SamplingParams(max_tokens=16),
    )
    ids = [
        smollm2.chat_ids(template_messages(parse_request({"messages": m, "tools": [WEATHER]}, True), False)[0])
        for m in (ask, follow)
    ]
    assert done.usage.prompt_tokens == len(ids[1])
    # the follow-up begins with the first call's prompt: its prefill is reused (the prefix cache, on by default)
    shared = next((i for i, (x, y) in enumerate(zip(*ids)) if x != y), len(ids[0]))
    assert shared > 100 and done.usage.prompt_tokens_details.cached_tokens >= shared
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    if done.choices[0].message.tool_calls:
        assert [t.function.name for t in calls] == [t.function.name for t in done.choices[0].message.tool_calls]
    else:
        assert streamed == done.choices[0].message.content == want.text and not calls
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_unknown_paths_and_methods_answer_in_openais_error_shape(server):
    for method, path, status in (("POST", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        req = urllib.request.Request(server + path, b"{}" if method == "POST" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == status and path in err["message"] and err["type"]
    models = json.loads(get(server, "/v1/models"))["data"][0]
    assert not models["drafter"].startswith("/")  # the checkpoint's folder name, not its absolute path
    ok = {
        **CHAT,
        "max_tokens": 2,
        "n": 1,
        "logprobs": False,
        "presence_penalty": 0,
        "response_format": {"type": "text"},
    }
    assert post(server, "/v1/chat/completions", ok)[0] == 200  # "off" values of unsupported fields are fine


LONG = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1500, "temperature": 0}  # counting on: a long generation


def _stream(base, body, out: list):
    """Reads one streamed completion to its end into `out` (chunks), in a thread."""
    import http.client

    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out.append(resp.status)
    for line in resp:
        out.append(line.decode().strip())


def test_limits_disconnects_and_sigterm(tmp_path):
    """One AR server with room for two requests: a body that never arrives whole is refused with 408, a dropped
    non-streaming request is aborted and recorded, a short request completes while a long stream decodes (it joins
    at the next round, not after the long one), a third request is refused with 429 + Retry-After while readiness
    says so, and SIGTERM ends the two open streams (finish_reason abort) within the grace period and exits."""
    import signal
    import socket
    import threading

    from dspine.serve.server import start_server_process

    extra = ["--max-queue", "2", "--grace-seconds", "3", "--body-timeout", "2"]
    proc, base = start_server_process(None, "smol", extra=extra, env={"DSPINE_READ_KEY": READ_KEY})
    try:
        # a body shorter than its Content-Length holds the connection only until --body-timeout: 408
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            s.sendall(b"Content-Length: 1000\r\n\r\n" + json.dumps(CHAT).encode()[:20])
            t0, answer = time.time(), s.recv(4096).decode()
            while "--body-timeout" not in answer and time.time() - t0 < 10:  # the body may come in a second segment
                more = s.recv(4096).decode()
                if not more:
                    break
                answer += more
        assert answer.startswith("HTTP/1.1 408") and "--body-timeout" in answer and time.time() - t0 < 10, answer
        assert json.loads(get(base, "/health"))["admitted"] == 0
        req = urllib.request.Request(
            base + "/v1/completions", json.dumps(LONG).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
            urllib.request.urlopen(req, timeout=2)
        deadline, rec = time.time() + 30, None
        while rec is None and time.time() < deadline:
            recs = json.loads(get(base, "/v1/dspine/requests"))["data"]
            rec = next((r for r in recs if r["finish_reason"] == "abort"), None)
            time.sleep(0.2)
        assert rec is not None and 0 < rec["completion_tokens"] < LONG["max_tokens"], rec
        assert json.loads(get(base, "/health"))["admitted"] == 0

        streams = [[], []]
        threads = [threading.Thread(target=_stream, args=(base, LONG, s), daemon=True) for s in streams]
        threads[0].start()
        while len(streams[0]) < 4 and time.time() < deadline + 30:  # the long stream is decoding
            time.sleep(0.1)
        t_short = time.time()
        status, body, _ = post(base, "/v1/completions", {**LONG, "max_tokens": 4})
        short_s = time.time() - t_short
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, body
        assert threads[0].is_alive() and not any("[DONE]" in x for x in streams[0][1:]), short_s  # long one still on
        threads[1].start()
        while json.loads(get(base, "/health"))["admitted"] < 2 and time.time() < deadline + 30:
            time.sleep(0.1)
        status, body, headers = post(base, "/v1/completions", {**LONG, "max_tokens": 4})
        assert (
            status == 429
            and json.loads(body)["error"]["code"] == "queue_full"
            and {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/ready", timeout=10)
        assert e.value.code == 503 and json.loads(e.value.read())["live"] is True

        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.time() - t0 < 3 + 10  # the grace period, plus the rows' last round and the exit
        for t in threads:
            t.join(timeout=10)
        for s in streams:
            lines = [x for x in s[1:] if x]
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert s[0] == 200 and lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "abort"
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(base + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_served_reply_equals_dspine_generate_up_to_the_context_window(tmp_path, capsys):
    """One decode loop: a request gives the same tokens through `dspine serve` (HTTP) and `dspine generate`, greedy
    fp32 — alone (the single-request draft tree), as two choices decoded side by side (batched chains), through
    `--draft-tree none` (chains), and AR's. The target is SmolLM2 with a 384-token window (its config edited), and
    the request runs into it: every path finishes with AR steps up to the window's last position."""
    from dspine.cli import main
    from dspine.drafters import builtin_drafter
    from dspine.serve.server import start_server_process
    from dspine.target import resolve_target_path

    src, small = resolve_target_path("smollm2-135m-instruct"), tmp_path / "smol384"
    small.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (small / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 384}))
    text = "Counting: " + ", ".join(str(i) for i in range(1, 81))  # continues without an end
    drafter = str(builtin_drafter("smollm2-135m-instruct"))

    def generate(*extra):
        assert main(["generate", "--target", str(small), "--raw", text, "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    ar = generate("--drafter", "none", "--max-tokens", "400")  # runs until the window stops it
    room = ar["completion_tokens"]
    assert ar["finish_reason"] == "length" and ar["prompt_tokens"] + room == 384 and room >= 24
    tree = generate("--drafter", drafter, "--max-tokens", str(room))
    chain = generate("--drafter", drafter, "--max-tokens", str(room), "--draft-tree", "none")
    assert tree["token_ids"] == chain["token_ids"] == ar["token_ids"]
    assert tree["draft_tree"] and "draft_tree" not in chain and tree["tau"] > 1 and chain["tau"] > 1
    proc, base = start_server_process(drafter, "smol", target=str(small))
    try:
        for path in ("/v1/dspine/requests", "/v1/dspine/drafter"):  # no read key, no admin key: reads are closed
            with pytest.raises(urllib.error.HTTPError) as closed:
                urllib.request.urlopen(base + path, timeout=30)
            assert closed.value.code == 403 and "--read-key" in json.loads(closed.value.read())["error"]["message"]
        body = {"model": "smol", "prompt": text, "max_tokens": room, "temperature": 0, "return_token_ids": True}
        for n in (1, 2):
            status, out, _ = post(base, "/v1/completions", {**body, "n": n})
            assert status == 200, out
            for choice in json.loads(out)["choices"]:
                assert choice["token_ids"] == ar["token_ids"] and choice["finish_reason"] == "length"
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_bad_seed_and_an_oversized_body_hurt_no_one_else(server):
    """A seed past 64 bits sent beside three good requests: 400 naming it, 200 for the others (refused before it
    joins a batch). A body whose Content-Length is over the limit: 413 before it is read, /health answering."""
    import socket
    import threading
    import time

    good = {"model": "smol", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "seed": 7}
    results: dict = {}
    bodies = {"bad": {**good, "seed": 2**64}, **{f"ok{k}": {**good, "seed": k} for k in range(3)}}
    threads = [
        threading.Thread(target=lambda n=n, b=b: results.__setitem__(n, post(server, "/v1/chat/completions", b)))
        for n, b in bodies.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["bad"][0] == 400 and json.loads(results["bad"][1])["error"]["param"] == "seed"
    assert all(results[f"ok{k}"][0] == 200 for k in range(3)), results
    host, port = server.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:  # 50 MB announced, nothing sent
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n"
        )
        answer = b""
        while not (b"\r\n\r\n" in answer and b"}" in answer.split(b"\r\n\r\n", 1)[1]):
            got = s.recv(4096)
            if not got:
                break
            answer += got
    text = answer.decode(errors="replace")
    assert text.startswith("HTTP/1.1 413") and "max-body-bytes" in text and time.monotonic() - t0 < 1.0
    assert json.loads(get(server, "/health"))


def test_a_bug_answers_a_json_500_with_an_id_that_the_log_names(caplog):
    """An exception no check foresaw (here the request parser itself breaks) is answered in OpenAI's error shape
    with an id, and the same id is logged with the traceback; the app answers the next request."""
    import types

    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry, Counter

    from dspine.serve.server import create_app

    def parse(body, chat):
        raise RuntimeError("the parser broke")

    errors = Counter("errors", "", ["status"], registry=CollectorRegistry())
    service = types.SimpleNamespace(
        cfg=types.SimpleNamespace(max_body_bytes=1 << 20), parse=parse, metrics=types.SimpleNamespace(errors=errors)
    )
    client = TestClient(create_app(service), raise_server_exceptions=False)
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=CHAT)
        err = r.json()["error"]
        assert r.status_code == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
        eid = err["message"].split("(id ")[1].split(",")[0]
        assert any(eid in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert errors.labels("500")._value.get() == 2
