"""The OpenAI Responses API on `dspine serve` (dspine/serve/responses.py): Responses bodies translated to the chat
request that decodes them, answered whole and streamed as the OpenAI client reads them, with the same tokens,
record and acceptance as chat completions, and what the server cannot do refused with a 400 naming the field."""

import pytest
from conftest import read_json_url, running_server

from dspine.checkpoint import save_drafter
from dspine.serve.protocol import RequestInvalid
from dspine.serve.responses import to_chat

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_a_responses_body_becomes_the_chat_request_that_decodes_it():
    body = {
        "model": "smol",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]},
        ],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "weather"},
        "max_output_tokens": 32,
        "reasoning": {"effort": "low"},
        "metadata": {"workload": "tool"},
        "stream": True,
        "return_token_ids": True,
        "store": False,
        "include": [],
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Lyon"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20 C"},
    ]
    fn = {k: WEATHER[k] for k in ("name", "description", "parameters")}
    assert chat["tools"] == [{"type": "function", "function": fn}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (chat["max_tokens"], chat["reasoning_effort"], chat["metadata"]) == (32, "low", {"workload": "tool"})
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True} and chat["return_token_ids"]
    assert to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no conversations"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "keeps no conversations"),
        ({"input": "x", "background": True}, "background", "answered while the request is open"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input", "text only"),
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input", "'computer_call' is not supported"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "role must be"),
        ({"input": []}, "input", "non-empty list"),
        ({"input": "x", "frequency": 1}, "frequency", "unknown parameter"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text", "not supported"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "arguments must be a string"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
    ],
)
def test_what_the_server_cannot_do_is_refused_by_name(body, param, needle):
    with pytest.raises(RequestInvalid, match=needle) as e:
        to_chat(body)
    assert e.value.param == param


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_drafters):
    ckpt = save_drafter(smollm2_drafters["dspine"][1], tmp_path_factory.mktemp("resp") / "dspine")
    with running_server(ckpt, "smol", max_prompt_tokens=400) as base:
        yield base


def test_the_openai_clients_responses_equal_chat_completions(server):
    """The same conversation through client.responses and client.chat.completions: the same text (greedy), the
    same token counts; streamed events add up to the whole; the record is found under the response's id; tool
    items round-trip; a refusal is a 400 naming the field and the server answers on."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, temperature=0
    )
    resp = client.responses.create(model="smol", input="Name three colours.", max_output_tokens=24, temperature=0)
    assert resp.output_text == chat.choices[0].message.content and resp.output[0].type == "message"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    # the same prompt again: all of it but its last token reused from the prefix cache, and said so
    assert resp.usage.input_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    record = read_json_url(f"{server}/v1/dspine/requests/{resp.id}")
    assert record["completion_tokens"] == resp.usage.output_tokens and record["spec"]["spec_verify_ct"] > 0

    events = list(
        client.responses.create(
            model="smol", input="Name three colours.", max_output_tokens=24, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{resp.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == resp.output_text
    assert events[-1].response.usage.output_tokens == resp.usage.output_tokens

    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
    ]
    done = client.responses.create(model="smol", input=turn, tools=[WEATHER], max_output_tokens=16, temperature=0)
    same = to_chat({"input": turn, "tools": [WEATHER]})
    follow = client.chat.completions.create(
        model="smol", messages=same["messages"], tools=same["tools"], max_tokens=16, temperature=0
    )
    calls = follow.choices[0].message.tool_calls or []
    assert [o.type for o in done.output] == (["message"] if follow.choices[0].message.content else []) + [
        "function_call"
    ] * len(calls)
    assert done.output_text == (follow.choices[0].message.content or "")

    with pytest.raises(BadRequestError, match="keeps no conversations"):
        client.responses.create(model="smol", input="x", previous_response_id=resp.id)
    assert client.responses.create(model="smol", input="Hi", max_output_tokens=4).usage.output_tokens == 4
