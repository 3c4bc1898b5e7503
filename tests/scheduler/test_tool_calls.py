"""The Hermes tool-call parser on Qwen3-format outputs: one call, parallel calls, text then a call,
braces and tags inside JSON strings, a tag split across stream chunks at every position, and bodies
that are not calls staying text."""
import json

import pytest

from nanoserve.v1 import llm_pb2
from scheduler_svc.tool_calls import ToolCallParser

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
BRACES = '<tool_call>\n{"name": "echo", "arguments": {"text": "a } { \\" </tool_call> ]"}}\n</tool_call>'


def parse(chunks: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser, text, calls = ToolCallParser(), "", []
    for chunk in chunks:
        shown, made = parser.feed(chunk)
        text += shown
        calls += made
    text += parser.finish()
    return text, [(call.name, json.loads(call.arguments)) for call in calls]


def test_one_call():
    assert parse([WEATHER]) == ("", [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_parallel_calls_leave_no_text_between_them():
    text, calls = parse([WEATHER + "\n" + WEATHER.replace("Paris", "Oslo") + "\n"])
    assert text == "" and [args["city"] for _, args in calls] == ["Paris", "Oslo"]


def test_text_then_a_call():
    assert parse(["Let me check that.\n\n" + WEATHER]) == ("Let me check that.\n\n",
                                                          [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_braces_and_a_closing_tag_inside_strings_do_not_end_the_call():
    """The first closing tag ends the body, which is then not JSON: the model's output is shown as
    it wrote it rather than guessed at."""
    text, calls = parse([BRACES.replace(" </tool_call> ", " ")])
    assert calls == [("echo", {"text": 'a } { " ]'})] and text == ""
    text, calls = parse([BRACES])
    assert calls == [] and text == BRACES


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


def test_an_unclosed_call_is_text_at_the_end():
    assert parse(["<tool_call>\n{\"name\": \"f\""]) == ("<tool_call>\n{\"name\": \"f\"", [])


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
