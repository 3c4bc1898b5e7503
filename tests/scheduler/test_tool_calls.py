"""The Hermes tool-call parser on Qwen3-format outputs: one call, parallel calls, text then a call,
braces, quotes and tags inside JSON strings, a tag split across stream chunks at every position, the
arguments handed on as they arrive (their parts joined are exactly the text the model wrote), and
bodies that are not calls staying text."""
import json

import pytest

from nanoserve.v1 import llm_pb2
from scheduler_svc.tool_calls import ToolCallParser

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
BRACES = '<tool_call>\n{"name": "echo", "arguments": {"text": "a } { \\" </tool_call> ]"}}\n</tool_call>'
BRACES_ARGUMENTS = '{"text": "a } { \\" </tool_call> ]"}'


def parse_parts(chunks: list[str]) -> tuple[str, list[llm_pb2.ToolCall], list[list[llm_pb2.ToolCall]]]:
    """The text shown, the calls whole (their parts joined) and each chunk's parts."""
    parser, text, calls, per_chunk = ToolCallParser(), "", [], []
    for chunk in chunks:
        shown, parts = parser.feed(chunk)
        text += shown
        per_chunk.append(parts)
        for part in parts:
            if part.id:  # a call opens with its index, id and name
                assert part.index == len(calls) and part.name and part.id.startswith("call_")
                calls.append(llm_pb2.ToolCall(id=part.id, name=part.name, arguments=part.arguments))
            else:
                assert not part.name and part.index == len(calls) - 1  # the open call's arguments go on
                calls[part.index].arguments += part.arguments
    text += parser.finish()
    return text, calls, per_chunk


def parse(chunks: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    text, calls, _ = parse_parts(chunks)
    return text, [(call.name, json.loads(call.arguments)) for call in calls]


def test_one_call():
    assert parse([WEATHER]) == ("", [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_parallel_calls_leave_no_text_between_them():
    text, calls = parse([WEATHER + "\n" + WEATHER.replace("Paris", "Oslo") + "\n"])
    assert text == "" and [args["city"] for _, args in calls] == ["Paris", "Oslo"]


def test_text_then_a_call():
    assert parse(["Let me check that.\n\n" + WEATHER]) == ("Let me check that.\n\n",
                                                          [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_braces_quotes_and_a_closing_tag_inside_strings_do_not_end_the_call():
    """Inside a JSON string a closing tag is text: the arguments end where their object does."""
    text, calls, _ = parse_parts([BRACES])
    assert text == "" and [(call.name, call.arguments) for call in calls] == [("echo", BRACES_ARGUMENTS)]
    assert json.loads(calls[0].arguments) == {"text": 'a } { " </tool_call> ]'}


OUTPUT = "Let me check.\n\n" + WEATHER + "\n" + BRACES + "\n"


def expected_arguments() -> list[str]:
    return ['{"city": "Paris", "unit": "celsius"}', BRACES_ARGUMENTS]


@pytest.mark.parametrize("split", range(len(OUTPUT) + 1))
def test_two_chunks_split_anywhere_give_the_same_calls(split):
    text, calls, _ = parse_parts([OUTPUT[:split], OUTPUT[split:]])
    assert text == "Let me check.\n\n"
    assert [(call.name, call.arguments) for call in calls] == list(zip(["get_weather", "echo"], expected_arguments()))


def test_arguments_are_handed_on_as_each_character_arrives():
    """Fed one character at a time, a call's arguments come out with no delay: after each character
    of the arguments object, the parts so far are the object's text up to it."""
    _, calls, per_chunk = parse_parts(list(OUTPUT))
    assert [call.arguments for call in calls] == expected_arguments()
    for arguments in expected_arguments():
        start = OUTPUT.index(arguments)
        fragments = [part.arguments for parts in per_chunk[start:start + len(arguments)] for part in parts]
        assert fragments == list(arguments)


def test_a_call_written_otherwise_comes_whole_at_its_closing_tag():
    """Arguments before the name (or not an object) cannot be streamed: the call comes in one part."""
    body = '{"arguments": {"a": 1}, "name": "f"}'
    text, calls, per_chunk = parse_parts([f"<tool_call>{body}", "</tool_call>"])
    assert text == "" and per_chunk[0] == [] and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    text, calls, _ = parse_parts(['<tool_call>{"name": "f", "arguments": "x"}</tool_call>'])
    assert [(c.name, c.arguments) for c in calls] == [("f", "x")]


@pytest.mark.parametrize("split", range(1, len("Sure <tool_call>\n{") + 1))
def test_a_tag_split_across_chunks(split):
    output = "Sure " + WEATHER + " done"
    assert parse([output[:split], output[split:]]) == ("Sure  done",
                                                      [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_every_chunk_one_character():
    output = "Hi <tool" + WEATHER + "<tool_cal"
    assert parse(list(output)) == ("Hi <tool<tool_cal", [("get_weather", {"city": "Paris", "unit": "celsius"})])


@pytest.mark.parametrize("body", ['{"arguments": {}}', "not json", '["get_weather"]', '{"name": ""}'])
def test_a_body_that_is_no_call_stays_text(body):
    output = f"<tool_call>{body}</tool_call>"
    assert parse([output]) == (output, [])


def test_an_unclosed_call_is_text_at_the_end_until_its_name_was_handed_on():
    assert parse(["<tool_call>\n{\"name\": \"f\""]) == ("<tool_call>\n{\"name\": \"f\"", [])
    text, calls, _ = parse_parts(['<tool_call>\n{"name": "f", "arguments": {"a": "b'])
    assert text == "" and [(call.name, call.arguments) for call in calls] == [("f", '{"a": "b')]


def test_apply_sets_tool_calls_and_the_finish_reason():
    parser = ToolCallParser()
    first = llm_pb2.GenerateResponse(text="ok " + WEATHER[:20])
    last = llm_pb2.GenerateResponse(text=WEATHER[20:], finish_reason=llm_pb2.FINISH_REASON_STOP)
    parser.apply(first)
    parser.apply(last)
    assert (first.text, len(first.tool_calls), last.text) == ("ok ", 0, "")
    assert [call.name for call in last.tool_calls] == ["get_weather"] and last.tool_calls[0].id.startswith("call_")
    assert last.finish_reason == llm_pb2.FINISH_REASON_TOOL_CALLS
    cut = llm_pb2.GenerateResponse(text=WEATHER, finish_reason=llm_pb2.FINISH_REASON_LENGTH)
    ToolCallParser().apply(cut)
    assert cut.finish_reason == llm_pb2.FINISH_REASON_LENGTH and len(cut.tool_calls) == 1
