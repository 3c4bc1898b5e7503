"""The scheduler's grammars, checked with llguidance itself on Qwen3's vocabulary: a constraint
after a thinking model's reasoning, the calls-only grammar of tool_choice required and of a named
function, and the tool errors a Chat request gets."""
import json
from pathlib import Path

import llguidance
import pytest

from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve.v1 import llm_pb2
from scheduler_svc.chat_tools import ChatTools, ToolError
from scheduler_svc.structured_outputs import GrammarCompiler

WEATHER = llm_pb2.Tool(name="get_weather", parameters=json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
NOOP = llm_pb2.Tool(name="noop")


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    return GrammarCompiler(GrammarTokenizer(Path(tiny_model_dir) / "tokenizer.json", 151936, (151645, 151643)))


def accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """The whole text is a complete sentence of the grammar."""
    tokenizer = compiler.tokenizer.get()
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    ids = tokenizer.tokenize_str(text, parse_special=True)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_a_constraint_applies_after_the_reasoning(compiler):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    opens = compiler.compile("json", schema, "open")
    assert accepts(compiler, opens, '<think>\nWhat is {a}? </think>\n\n{"a": 1}')
    assert not accepts(compiler, opens, '{"a": 1}')
    assert accepts(compiler, compiler.compile("json", schema, "opened"), 'the prompt opened it</think>{"a": 2}')
    assert accepts(compiler, compiler.compile("json", schema), '{"a": 3}')


def chat_tools(*tools: llm_pb2.Tool, **choice) -> ChatTools:
    return ChatTools(llm_pb2.ChatRequest(tools=tools, tool_choice=llm_pb2.ToolChoice(**choice)))


def test_required_takes_calls_of_any_tool_and_nothing_else(compiler):
    grammar = compiler.compile("grammar", chat_tools(WEATHER, NOOP, mode=llm_pb2.ToolChoice.MODE_REQUIRED).grammar())
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    noop = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert accepts(compiler, grammar, weather) and accepts(compiler, grammar, weather + "\n" + noop)
    assert not accepts(compiler, grammar, "Sure. " + weather)
    assert not accepts(compiler, grammar, weather.replace("get_weather", "get_time"))
    assert not accepts(compiler, grammar, weather.replace('{"city": "Oslo"}', "{}"))  # city is required


def test_a_named_function_is_called_once(compiler):
    grammar = compiler.compile("grammar", chat_tools(WEATHER, NOOP, function="noop").grammar())
    noop = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert accepts(compiler, grammar, noop) and not accepts(compiler, grammar, noop + "\n" + noop)
    assert not accepts(compiler, grammar, noop.replace("noop", "get_weather"))


@pytest.mark.parametrize("tools, choice, message", [
    ([llm_pb2.Tool()], {}, "tools[0] has no function name"),
    ([llm_pb2.Tool(name="bad name")], {}, "function name 'bad name' must be"),
    ([WEATHER], {"function": "get_time"}, "tool_choice names function 'get_time', which is not among"),
    ([], {"mode": llm_pb2.ToolChoice.MODE_REQUIRED}, "the request has no tools"),
    ([llm_pb2.Tool(name="f", parameters="[1")], {}, "tools[0] (f): parameters is not valid JSON"),
])
def test_bad_tools_are_refused_naming_which(tools, choice, message):
    with pytest.raises(ToolError, match=None) as raised:
        chat_tools(*tools, **choice)
    assert message in str(raised.value)


def test_a_tools_schema_that_does_not_compile_names_the_tool(compiler):
    tools = chat_tools(WEATHER, llm_pb2.Tool(name="f", parameters='{"type": "frobnicate"}'))
    with pytest.raises(ToolError) as raised:
        tools.sampling(llm_pb2.SamplingParams(), compiler)
    assert "tools[1] (f): parameters: structured_outputs.json: Invalid type: frobnicate" in str(raised.value)


def test_a_structural_tag_holds_only_its_segments(compiler):
    spec = {"structures": [{"begin": "<f=add>", "schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}, "end": "</f>"}],
        "triggers": ["<f="]}
    grammar = compiler.compile("structural_tag", json.dumps(spec))
    assert accepts(compiler, grammar, 'Adding now <f=add>{"a": 1}</f> and done.')
    assert accepts(compiler, grammar, "No call at all.")
    assert not accepts(compiler, grammar, 'Adding now <f=add>{"b": 1}</f>')
