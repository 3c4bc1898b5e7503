"""OpenAI's structured output and function calling in a request body, as the scheduler's fields:
response_format (text, json_object, json_schema) and vLLM's structured_outputs -> SamplingParams'
structured_outputs; tools, tool_choice and the conversation's tool calls -> ChatRequest's. The
scheduler checks what they say (a schema that does not compile, a tool without a name, a
tool_choice naming no tool) and its 400 names the parameter; here only their shapes are read."""
import json
from typing import Any

from gateway_svc.errors import bad_request
from nanoserve.v1 import llm_pb2

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_MODES = {"auto": llm_pb2.ToolChoice.MODE_AUTO, "none": llm_pb2.ToolChoice.MODE_NONE,
          "required": llm_pb2.ToolChoice.MODE_REQUIRED}


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def response_format(value: dict[str, Any] | None) -> llm_pb2.StructuredOutputs | None:
    """OpenAI's response_format as a constraint (None for plain text)."""
    kind = (value or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return llm_pb2.StructuredOutputs(json_object=True)
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return llm_pb2.StructuredOutputs(json=json.dumps(schema))
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def structured_outputs(value: dict[str, Any]) -> llm_pb2.StructuredOutputs:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object, structural_tag."""
    given = [kind for kind in _KINDS if value.get(kind) not in (None, False)]
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {', '.join(_KINDS)}", "structured_outputs")
    kind, field = given[0], value[given[0]]
    if kind == "choice":
        if not isinstance(field, list) or not all(isinstance(choice, str) for choice in field):
            raise bad_request("structured_outputs.choice must be a list of strings", "structured_outputs")
        return llm_pb2.StructuredOutputs(choice=llm_pb2.ChoiceList(choices=field))
    if kind == "json_object":
        return llm_pb2.StructuredOutputs(json_object=True)
    if kind in ("regex", "grammar") and not isinstance(field, str):
        raise bad_request(f"structured_outputs.{kind} must be a string", "structured_outputs")
    return llm_pb2.StructuredOutputs(**{kind: _json_text(field) if kind in ("json", "structural_tag") else field})


def tools(value: list[dict[str, Any]] | None) -> list[llm_pb2.Tool]:
    out = []
    for i, tool in enumerate(value or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        parameters = function.get("parameters")
        out.append(llm_pb2.Tool(name=str(function.get("name") or ""), description=str(function.get("description") or ""),
                                parameters="" if parameters is None else _json_text(parameters)))
    return out


def tool_choice(value: str | dict[str, Any] | None) -> llm_pb2.ToolChoice | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in _MODES:
            raise bad_request(f"tool_choice must be none, auto, required or a function, got {value!r}", "tool_choice")
        return llm_pb2.ToolChoice(mode=_MODES[value])
    name = (value.get("function") or {}).get("name")
    if value.get("type") != "function" or not isinstance(name, str):
        raise bad_request('tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    return llm_pb2.ToolChoice(function=name)


def message_tool_calls(message: dict[str, Any], index: int) -> list[llm_pb2.ToolCall]:
    """An assistant message's tool_calls (OpenAI's shape, arguments as a JSON string)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"messages[{index}].tool_calls entries need a function with a name", "messages")
        calls.append(llm_pb2.ToolCall(id=str(call.get("id") or ""), name=function["name"],
                                      arguments=_json_text(function.get("arguments", "{}"))))
    return calls


def tool_calls_json(calls: list[llm_pb2.ToolCall]) -> list[dict]:
    """A reply's calls as OpenAI's message.tool_calls."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]
