"""The OpenAI chat surface on fixed text: tool calls parsed out of generated text, malformed ones kept as
content, requests rendered for a template without a tools section, and the streamed reply of a tool call."""

import json

import pytest

from dspine.engine import Engine, GenerationResult
from dspine.sampling import SamplingParams
from dspine.serve.protocol import (
    RequestInvalid,
    parse_request,
    parse_tool_calls,
    streamable_prefix,
    template_messages,
)
from dspine.serve.records import RequestRecord
from dspine.serve.server import Parsed, ServeConfig, Service, Stream

NAMES = {"get_weather", "add"}


def test_tool_call_blocks_become_tool_calls():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"a": 1, "b": 2}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # truncated JSON
        '<tool_call>{"name": "get_weather"} {"x": 1}</tool_call>',  # two objects
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not an offered function
        '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}</tool_call> <tool_call>[1, 2]</tool_call>',  # one bad block
        '<tool_call>{"name": "add", "arguments": {}}',  # never closed
    ],
)
def test_malformed_tool_calls_stay_plain_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_bare_json_call_fallback_only_for_offered_functions():
    content, calls = parse_tool_calls(' {"name": "add", "parameters": {"a": 1}} ', NAMES)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert parse_tool_calls('{"name": "other", "arguments": {}}', NAMES)[1] == []
    assert parse_tool_calls('{"answer": 42}', NAMES)[1] == []


def test_streaming_holds_back_what_could_be_a_tool_call():
    assert streamable_prefix("Sure, <tool_c") == "Sure, "
    assert streamable_prefix("Sure, <tool_call>{") == "Sure, "
    assert streamable_prefix("Sure, a < b") == "Sure, a < b"
    assert streamable_prefix('  {"name"') == ""


def test_rendering_without_a_tools_section():
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Add "}, {"type": "text", "text": "1 and 2"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    }
    msgs, kw = template_messages(parse_request(body, True), native_tools=False)
    assert kw == {}
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in msgs[0]["content"]
    assert msgs[1] == {"role": "user", "content": "Add 1 and 2"}
    assert json.loads(msgs[2]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0]) == {
        "name": "add",
        "arguments": {"a": 1},
    }
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    none = parse_request({**body, "tool_choice": "none"}, True)
    assert "# Tools" not in template_messages(none, False)[0][0]["content"]


def test_request_errors_name_the_field():
    with pytest.raises(RequestInvalid) as e:
        parse_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, True)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestInvalid, match="JSON object"):
        parse_request([1, 2], True)
    ok = parse_request({"messages": [{"role": "user", "content": "x"}], "unknown_field": 1, "max_tokens": 3.0}, True)
    assert ok.max_tokens == 3


def test_service_reply_of_malformed_or_good_tool_output(tiny):
    """The server's own reply path (non-streaming and streamed) on fixed generated text: a malformed call is
    plain content with the generation's finish reason, a good one is tool_calls — never an exception."""
    target, _ = tiny
    service = Service(Engine(target), ServeConfig(model_name="m"))
    req = Parsed(
        ids=[1, 2],
        params=SamplingParams(max_tokens=4),
        effort="none",
        stream=False,
        workload="w",
        details=False,
        meta_info=False,
        token_ids=False,
        tool_names=NAMES,
    )
    for text, want_calls in (
        ('<tool_call>{"name": "add", "arguments": {"a": </tool_call>', 0),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', 1),
    ):
        rec = RequestRecord(
            request_id=req.id, model="m", prompt_tokens=2, completion_tokens=9, text=text, finish_reason="length"
        )
        res = GenerationResult(token_ids=[5] * 9, text=text, finish_reason="length", prompt_tokens=2, method="ar")
        choice = service.response(req, rec, [res], chat=True)["choices"][0]
        assert len(choice["message"].get("tool_calls", [])) == want_calls
        assert choice["finish_reason"] == ("tool_calls" if want_calls else "length")
        assert choice["message"]["content"] == (None if want_calls else text)
        events = [json.loads(e[6:]) for e in Stream(service, req, True).finish(res, rec) if e != "data: [DONE]\n\n"]
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        deltas = [t for e in events for t in e["choices"][0]["delta"].get("tool_calls", [])]
        assert streamed == ("" if want_calls else text) and len(deltas) == want_calls
        assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_parallel_tool_calls_false_keeps_the_first_call(tiny):
    target, _ = tiny
    service = Service(Engine(target), ServeConfig(model_name="m"))
    text = "\n".join(f'<tool_call>{{"name": "add", "arguments": {{"a": {a}}}}}</tool_call>' for a in (1, 2))
    for one, want in ((False, 2), (True, 1)):
        req = Parsed(
            ids=[1],
            params=SamplingParams(max_tokens=4),
            effort="none",
            stream=False,
            workload="w",
            details=False,
            meta_info=False,
            token_ids=False,
            tool_names=NAMES,
            one_call=one,
        )
        _, calls, finish, _ = service.reply(req, text, "stop")
        assert len(calls) == want and finish == "tool_calls" and '"a": 1' in calls[0]["function"]["arguments"]
    body = {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": False}
    assert parse_request(body, True).parallel_tool_calls is False
