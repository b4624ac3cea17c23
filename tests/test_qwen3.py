"""The Qwen3 path with the real Qwen3 tokenizer (tests/data/qwen3_tokenizer: its vocabulary, thinking and tools
template) on a tiny random Qwen3-architecture target: requests render as Qwen3's own template renders them with
thinking on and off and tools offered; a thinking reply comes back with its <think> block as `reasoning_content`
(whole and streamed) and tool calls parsed from what follows; and a replay through the real `dspine serve` records
acceptance per level, the levels' prompts differing by the empty think block that thinking off adds."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_target

from dspine.serve.protocol import parse_tool_calls, split_reasoning

ROOT = Path(__file__).resolve().parents[1]
TOK = ROOT / "tests" / "data" / "qwen3_tokenizer"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear", "celsius": 21}'},
    {"role": "user", "content": "And should I take a coat?"},
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 (the real vocabulary size; conftest's tiny target) saved with the real tokenizer: a
    target folder."""
    d = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3"
    d.mkdir()
    with gzip.open(TOK / "tokenizer.json.gz", "rb") as src, open(d / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(TOK / "tokenizer_config.json", d / "tokenizer_config.json")
    tiny_target("qwen3", vocab=151936, hidden=32, layers=2).model.save_pretrained(d)
    return d


def test_requests_render_as_qwen3s_template_with_thinking_on_and_off(qwen3_dir):
    from transformers import AutoTokenizer

    from dspine.agents.replay import Renderer

    r = Renderer(str(qwen3_dir))
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    assert len(tok) == 151669 and r.model_type == "qwen3"
    native = [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in MESSAGES
    ]
    for level, thinking in (("none", False), ("high", True)):
        ids = r.ids(MESSAGES, TOOLS, level)
        want = tok.apply_chat_template(native, tools=TOOLS, enable_thinking=thinking, add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert ids == list(want)
        text = tok.decode(ids)
        assert "# Tools" in text and '"name": "get_weather"' in text and "<tool_response>" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        tail = "<|im_start|>assistant\n<think>\n\n</think>\n\n" if not thinking else "<|im_start|>assistant\n"
        assert text.endswith(tail)
    off, on = r.ids(MESSAGES, TOOLS, "none"), r.ids(MESSAGES, TOOLS, "high")
    assert off[: len(on)] == on and tok.decode(off[len(on) :]) == "<think>\n\n</think>\n\n"


def test_a_thinking_reply_splits_into_reasoning_content_and_tool_calls(qwen3_dir):
    from transformers import AutoTokenizer

    from dspine.serve.openai import Stream

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    reply = '<think>\nThe user asks about a coat; 21 degrees is mild.\n</think>\n\nNo coat needed.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'  # noqa: E501
    ids = tok.encode(reply, add_special_tokens=False)
    assert 151667 in ids and 151668 in ids and 151657 in ids  # <think>, </think>, <tool_call> as single tokens
    text = tok.decode(ids, skip_special_tokens=True)  # as the server decodes: the tags survive
    reasoning, rest = split_reasoning(text)
    assert reasoning == "The user asks about a coat; 21 degrees is mild."
    content, calls = parse_tool_calls(rest, {"get_weather"})
    assert content == "No coat needed." and calls[0]["function"]["name"] == "get_weather"
    assert split_reasoning("Plain answer.") == (None, "Plain answer.")
    assert split_reasoning("<think>\ncut off mid-thought") == ("cut off mid-thought", "")
    # streamed: reasoning deltas while the block is open, content only after it closes
    s = Stream.__new__(Stream)
    s.thought = ""
    deltas, contents = [], []
    for k in range(1, len(ids) + 1):
        delta, content = s.reasoning(tok.decode(ids[:k], skip_special_tokens=True))
        if delta:
            deltas.append(delta)
        if content is not None:
            contents.append(content)
        else:
            assert "</think>" not in tok.decode(ids[:k], skip_special_tokens=True)
    assert "".join(deltas) == reasoning and contents[-1] == rest and not any("<think>" in c for c in contents)


def test_replay_records_acceptance_per_level_through_the_server(qwen3_dir, tmp_path):
    from dspine.agents.traces import load_traces
    from dspine.checkpoint import save_drafter
    from dspine.drafter import DSpineDraftModel
    from dspine.serve.server import start_server_process
    from dspine.target import load_target

    target = load_target(str(qwen3_dir))
    ckpt = save_drafter(DSpineDraftModel.for_target(target, num_hidden_layers=1, block_size=4), tmp_path / "d")
    convo = {
        "id": "c",
        "task_id": "weather",
        "workload": "assist",
        "tools": TOOLS,
        "messages": [*MESSAGES, {"role": "assistant", "content": "<think>\nMild.\n</think>\n\nNo coat."}],
    }
    (tmp_path / "c.jsonl").write_text(json.dumps(convo) + "\n")
    # fixed: every round drafts (goodput would turn this random drafter's rounds into AR ones)
    proc, base = start_server_process(str(ckpt), "qwen", target=str(qwen3_dir), extra=["--draft-policy", "fixed"])
    try:
        out = tmp_path / "rows"
        r = subprocess.run(
            [
                sys.executable,
                str(ROOT / "adapt" / "collect.py"),
                "--source",
                "replay",
                "--conversations",
                str(tmp_path / "c.jsonl"),
                "--endpoint",
                base + "/v1",
                "--levels",
                "none,high",
                "--max-tokens",
                "6",
                "--executor",
                "local",
                "--concurrency",
                "1",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        rows = {row["thinking"]: row for row in load_traces(str(out)).to_pylist()}
        assert set(rows) == {"none", "high"}
        for row in rows.values():
            assert sum(row["accept_hist"]) >= 1 and row["tau"] >= 1.0 and row["task_id"] == "weather"
            assert json.loads(row["sampling"])["reasoning_effort"] == row["thinking"]
        off, on = rows["none"]["prompt_token_ids"], rows["high"]["prompt_token_ids"]
        assert off[: len(on)] == on and target.tokenizer.decode(off[len(on) :]) == "<think>\n\n</think>\n\n"
        import urllib.request

        body = {"model": "qwen", "messages": MESSAGES[:2], "max_tokens": 4, "reasoning_effort": "high"}
        req = urllib.request.Request(
            base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            msg = json.loads(resp.read())["choices"][0]["message"]
        assert "<think>" not in (msg.get("content") or "")  # a block, if the random model opens one, is apart
    finally:
        proc.terminate()
        proc.wait(timeout=30)
