"""Structured output and function calling through the gateway, with the official `openai` SDK (and
LangChain's ChatOpenAI): response_format json_schema outputs that stop validate with `jsonschema`;
tool_choice required and a named function return calls whose arguments follow the tool's schema,
with finish_reason tool_calls, the same streamed (OpenAI's deltas, the arguments in fragments,
reassembled) as whole; a conversation carrying the calls and their results goes on; the gRPC Chat
gives the same calls; bad schemas and tools are 400s naming the parameter. The demo model does not
reason, so requests turn Qwen3's thinking off (the grammar would otherwise wait for its </think>)."""
import json

import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from nanoserve.v1 import llm_pb2

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                       "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def create(oai, model_name, stream: bool, **params) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of one chat completion, whole or streamed."""
    params = {"model": model_name, "messages": MESSAGES, "max_tokens": 96, "temperature": 0, "extra_body": NO_THINKING,
              **params}
    if not stream:
        choice = oai.chat.completions.create(**params).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(**params, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.id:  # a call opens with its id and name, then its arguments arrive
                    assert delta.index == len(calls) and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(call) for _, call in sorted(calls.items())], finish


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(oai, model_name, stream):
    schema = SCHEMAS["get_weather"]
    content, calls, finish = create(oai, model_name, stream, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}})
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), schema)


def test_vllm_structured_outputs_on_completions(oai, model_name):
    choices = ["red", "green", "blue"]
    got = oai.completions.create(model=model_name, prompt="A color:", max_tokens=8, n=4, seed=3,
                                 extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in got.choices)
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=model_name, prompt="A color:", max_tokens=8,
                               extra_body={"structured_outputs": {"choice": choices, "regex": "x"}})
    assert raised.value.response.json()["error"]["param"] == "structured_outputs"


def test_tool_choice_required_calls_tools_streamed_as_whole(oai, model_name):
    whole = create(oai, model_name, False, tools=TOOLS, tool_choice="required")
    content, calls, finish = whole
    assert finish == "tool_calls" and content is None
    check_calls(calls)
    assert create(oai, model_name, True, tools=TOOLS, tool_choice="required") == whole


def test_a_streamed_call_opens_then_its_arguments_arrive_in_fragments(oai, model_name):
    """As OpenAI streams a call: a delta with its index, id, type and name (arguments ""), then its
    arguments' text over several deltas, which joined are the non-streamed call's arguments exactly."""
    params = {"model": model_name, "messages": MESSAGES, "max_tokens": 96, "temperature": 0, "extra_body": NO_THINKING,
              "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    deltas = [delta for chunk in oai.chat.completions.create(**params, stream=True) for choice in chunk.choices
              for delta in choice.delta.tool_calls or []]
    opening, fragments = deltas[0], [delta.function.arguments for delta in deltas[1:]]
    assert (opening.index, opening.type, opening.function.name, opening.function.arguments) == (
        0, "function", "get_weather", "") and opening.id.startswith("call_")
    assert all(delta.index == 0 and delta.id is None for delta in deltas[1:]) and len(fragments) > 2
    whole = oai.chat.completions.create(**params).choices[0].message.tool_calls
    assert "".join(fragments) == whole[0].function.arguments


def test_a_named_function_is_called_once(oai, model_name):
    for stream in (False, True):
        content, calls, finish = create(oai, model_name, stream, tools=TOOLS, parallel_tool_calls=True,
                                        tool_choice={"type": "function", "function": {"name": "add"}})
        assert finish == "tool_calls" and [name for name, _ in calls] == ["add"]
        check_calls(calls)


def test_a_conversation_with_calls_and_results_goes_on(oai, model_name):
    reply = oai.chat.completions.create(model=model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        max_tokens=96, temperature=0, extra_body=NO_THINKING).choices[0].message
    results = [{"role": "tool", "tool_call_id": call.id, "content": "18"} for call in reply.tool_calls]
    follow_up = MESSAGES + [reply.model_dump(exclude_none=True)] + results
    answer = oai.chat.completions.create(model=model_name, messages=follow_up, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0, extra_body=NO_THINKING)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None


def test_the_grpc_chat_returns_the_same_calls(oai, model_name, grpc_client):
    _, calls, _ = create(oai, model_name, False, tools=TOOLS, tool_choice="required")
    tools = [llm_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                          parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    got = grpc_client.chat(MESSAGES, max_tokens=96, temperature=0, tools=tools, chat_template_kwargs=NO_THINKING[
        "chat_template_kwargs"], tool_choice=llm_pb2.ToolChoice(mode=llm_pb2.ToolChoice.MODE_REQUIRED))
    assert got.finish_reason == "FINISH_REASON_TOOL_CALLS" and got.text == ""
    assert [(call.name, call.arguments) for call in got.tool_calls] == calls


def test_langchain_bind_tools_round_trip(gateway, model_name):
    llm = ChatOpenAI(base_url=gateway + "/v1", api_key="unused", model=model_name, temperature=0,
                                      max_tokens=96, extra_body=NO_THINKING, max_retries=0)
    bound = llm.bind_tools(TOOLS, tool_choice="add")
    question = HumanMessage("What is 2 + 3?")
    reply = bound.invoke([question])
    assert [call["name"] for call in reply.tool_calls] == ["add"], reply
    jsonschema.validate(reply.tool_calls[0]["args"], SCHEMAS["add"])
    answer = llm.invoke([question, reply, ToolMessage("5", tool_call_id=reply.tool_calls[0]["id"])])
    assert isinstance(answer.content, str)


@pytest.mark.parametrize("params, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format", "Invalid type: frobnicate"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"required": ["a"]}}}}}, "response_format", 'Unimplemented keys: ["if"]'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "tools[0] has no function name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "divide"}}}, "tool_choice",
     "names function 'divide', which is not among the request's tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]}, "tools",
     "tools[0] (f): parameters"),
])
def test_bad_structured_requests_are_400_naming_the_parameter(oai, model_name, params, param, fragment):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, **params)
    error = raised.value.response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
