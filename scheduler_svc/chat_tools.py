"""A Chat request's tools: checked (INVALID_ARGUMENT naming the tool and what is wrong), written
for the chat template (OpenAI's shape, as Qwen3's template reads it), and, for tool_choice REQUIRED
or a named function, the grammar that makes the reply calls only: Hermes-format calls whose JSON
has the tool's name and arguments following its parameters schema."""
import json
import re

from nanoserve.v1 import llm_pb2
from scheduler_svc.structured_outputs import JSON_DEFAULTS, ConstraintError, GrammarCompiler

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MODE = llm_pb2.ToolChoice.Mode


class ToolError(ValueError):
    """A request whose tools or tool_choice cannot be served; the message says which."""


def _parameters(tool: llm_pb2.Tool, index: int) -> dict:
    if not tool.parameters:
        return {"type": "object"}
    try:
        schema = json.loads(tool.parameters)
    except json.JSONDecodeError as err:
        raise ToolError(f"tools[{index}] ({tool.name}): parameters is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise ToolError(f"tools[{index}] ({tool.name}): parameters must be a JSON schema object")
    return schema


class ChatTools:
    """The tools of one Chat request and what its tool_choice asks for."""

    def __init__(self, request: llm_pb2.ChatRequest):
        self.tools = list(request.tools)
        for i, tool in enumerate(self.tools):
            if not tool.name:
                raise ToolError(f"tools[{i}] has no function name")
            if not _NAME.fullmatch(tool.name):
                raise ToolError(f"tools[{i}]: function name {tool.name!r} must be 1 to 64 letters, digits, _ or -")
        self.parameters = [_parameters(tool, i) for i, tool in enumerate(self.tools)]
        choice = request.tool_choice
        self.function = choice.function if choice.WhichOneof("choice") == "function" else ""
        self.mode = _MODE.MODE_AUTO if self.function else choice.mode
        if (self.function or self.mode == _MODE.MODE_REQUIRED) and not self.tools:
            raise ToolError("tool_choice asks for a tool call, but the request has no tools")
        if self.function and self.function not in {tool.name for tool in self.tools}:
            raise ToolError(f"tool_choice names function {self.function!r}, which is not among the request's tools")
        self.parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True

    @property
    def active(self) -> bool:
        """The model sees the tools and its output is parsed for calls."""
        return bool(self.tools) and self.mode != _MODE.MODE_NONE

    @property
    def forced(self) -> bool:
        """The reply must be calls (REQUIRED or a named function)."""
        return bool(self.function) or self.mode == _MODE.MODE_REQUIRED

    def sampling(self, sampling: llm_pb2.SamplingParams, grammars: GrammarCompiler) -> llm_pb2.SamplingParams:
        """The request's sampling once each tool's parameters compiled as a schema (ToolError naming the
        tool otherwise); for a reply that must call tools, with their grammar as its constraint."""
        if not self.active:
            return sampling
        for i, (tool, parameters) in enumerate(zip(self.tools, self.parameters)):
            try:
                grammars.compile("json", json.dumps(parameters))
            except ConstraintError as err:
                raise ToolError(f"tools[{i}] ({tool.name}): parameters: {err}") from None
        if not self.forced:
            return sampling
        if sampling.HasField("structured_outputs"):
            raise ToolError("tool_choice required or a named function cannot be combined with structured_outputs")
        forced = llm_pb2.SamplingParams()
        forced.CopyFrom(sampling)
        forced.structured_outputs.grammar = self.grammar()
        return forced

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's request shape)."""
        return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                  "parameters": parameters}}
                for tool, parameters in zip(self.tools, self.parameters)]

    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect) of a reply made of calls only: exactly one call of
        the named function, or one or more calls (one without parallel_tool_calls) of any tool."""
        chosen = [(tool, parameters) for tool, parameters in zip(self.tools, self.parameters)
                  if not self.function or tool.name == self.function]
        calls = [{"type": "object", "properties": {"name": {"const": tool.name}, "arguments": parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for tool, parameters in chosen]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema["x-guidance"] = JSON_DEFAULTS  # Qwen3 writes its calls as json.dumps does
        repeat = ' ("\\n" call)*' if self.parallel and not self.function else ""
        return f'start: call{repeat}\ncall: <tool_call> "\\n" %json {json.dumps(schema)} "\\n" </tool_call>\n'


def template_message(message: llm_pb2.ChatMessage) -> dict:
    """A conversation message as chat templates take it: an assistant's calls with their arguments
    as objects where they are JSON (Qwen3's template writes an object as JSON, a string as it is)."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": _arguments(call.arguments)}}
                             for call in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
