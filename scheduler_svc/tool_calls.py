"""Tool calls out of a chat completion's streamed text, in the Hermes format Qwen3's template teaches:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them, after or without
text. Text is handed on as it comes, except what may be the start of a `<tool_call>` tag (held back
until it is or is not one) and the calls' markup. A call is handed on in parts, as OpenAI streams
one: once its name is written, a part with its index, id and name; then its arguments object's
text as it arrives, exactly as the model writes it (the parts joined are the call's `arguments`).
A body written otherwise (arguments first, arguments not an object) is handed on whole once its
closing tag arrives, or stays in the text, as written, when it is not a call (not JSON, no name)."""
import json
import re
import uuid

from nanoserve.v1 import llm_pb2

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A body up to its arguments object: `{"name": "<name>", "arguments": ` before the object's `{`.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\<]|\\.)+")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_TEXT, _HEAD_NEXT, _ARGUMENTS, _TAIL = range(4)  # where the parser is: see ToolCallParser.feed


def _held_back(text: str) -> int:
    """Length of the longest end of `text` that begins OPEN (it may continue into the tag)."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str) -> llm_pb2.ToolCall | None:
    """The call a whole tag's body writes, or None when it writes none."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return llm_pb2.ToolCall(id=_call_id(), name=call["name"], arguments=arguments)


class JsonExtent:
    """Where a JSON object written piece by piece ends: its nesting and strings, character by character
    (a brace or a tag inside a string is text). Markup outside a string (`<`, as a closing tag begins)
    ends it early: the model broke off the JSON."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def take(self, text: str) -> tuple[int, bool]:
        """How much of `text`, which follows what was taken before, is the object's, and whether it ends there."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if not self.depth:
                    return i + 1, True
            elif char == "<":
                return i, True
        return len(text), False


class ToolCallParser:
    def __init__(self, resumed_text: str = ""):
        """`resumed_text`: a resumed completion's text, which its client has parsed already."""
        self.pending = ""  # text not handed on yet: a tag's possible start, a call's head or its markup
        self.state = _TEXT
        self.extent = JsonExtent()  # the arguments of the call being streamed
        self.num_calls = 0
        self.feed(resumed_text)

    def feed(self, text: str) -> tuple[str, list[llm_pb2.ToolCall]]:
        """The text to show and the calls' parts, of `text` added to what came before: a call's first
        part has its index, id and name, the next ones (same index) the following text of its arguments."""
        self.pending += text
        shown: list[str] = []
        parts: list[llm_pb2.ToolCall] = []
        while self._step(shown, parts):
            pass
        return "".join(shown), parts

    def _step(self, shown: list[str], parts: list[llm_pb2.ToolCall]) -> bool:
        """Moves on through `pending` as far as the current state goes; False when it needs more text."""
        return {_TEXT: self._text, _HEAD_NEXT: self._head, _ARGUMENTS: self._arguments,
                _TAIL: self._tail}[self.state](shown, parts)

    def _text(self, shown: list[str], parts: list[llm_pb2.ToolCall]) -> bool:
        start = self.pending.find(OPEN)
        if start < 0:
            keep = len(self.pending) - _held_back(self.pending)
            self._show(shown, self.pending[:keep])
            self.pending = self.pending[keep:]
            return False
        self._show(shown, self.pending[:start])
        self.pending, self.state = self.pending[start + len(OPEN):], _HEAD_NEXT
        return True

    def _head(self, shown: list[str], parts: list[llm_pb2.ToolCall]) -> bool:
        """A call's head opens it; without one, the whole body at its closing tag is a call or text."""
        head = _HEAD.match(self.pending)
        name = _json_string(head.group(1)) if head else None
        if name:
            self._open(parts, llm_pb2.ToolCall(id=_call_id(), name=name))
            self.pending, self.state, self.extent = self.pending[head.end():], _ARGUMENTS, JsonExtent()
            return True
        end = self.pending.find(CLOSE)
        if end < 0:
            return False
        body, self.pending, self.state = self.pending[:end], self.pending[end + len(CLOSE):], _TEXT
        call = parse_call(body)
        if call is None:
            self._show(shown, OPEN + body + CLOSE)
        else:
            self._open(parts, call)
        return True

    def _arguments(self, shown: list[str], parts: list[llm_pb2.ToolCall]) -> bool:
        size, ended = self.extent.take(self.pending)
        if size:
            self._add(parts, llm_pb2.ToolCall(index=self.num_calls - 1, arguments=self.pending[:size]))
        self.pending = self.pending[size:]
        if ended:
            self.state = _TAIL
        return ended

    def _tail(self, shown: list[str], parts: list[llm_pb2.ToolCall]) -> bool:
        """The rest of the body, up to the closing tag, is markup."""
        end = self.pending.find(CLOSE)
        if end < 0:
            return False
        self.pending, self.state = self.pending[end + len(CLOSE):], _TEXT
        return True

    def _open(self, parts: list[llm_pb2.ToolCall], call: llm_pb2.ToolCall) -> None:
        """Hands on a call's first part, numbered."""
        call.index = self.num_calls
        self.num_calls += 1
        self._add(parts, call)

    @staticmethod
    def _add(parts: list[llm_pb2.ToolCall], part: llm_pb2.ToolCall) -> None:
        """Appends `part`, joined to the one before when it goes on with the same call's arguments."""
        if parts and not part.id and parts[-1].index == part.index:
            parts[-1].arguments += part.arguments
        else:
            parts.append(part)

    def finish(self) -> str:
        """At the end of the output: what is still held back, as text (a call whose name was not
        handed on included; a call handed on in part stays a call)."""
        rest = {_TEXT: self.pending, _HEAD_NEXT: OPEN + self.pending}.get(self.state, "")
        self.pending, self.state = "", _TEXT
        shown: list[str] = []
        self._show(shown, rest)
        return "".join(shown)

    def _show(self, shown: list[str], text: str) -> None:
        """Appends `text`, but for blank text once a call is made: the lines between and after calls are markup."""
        if text.strip() or not self.num_calls:
            shown.append(text)

    def apply(self, message: llm_pb2.GenerateResponse) -> None:
        """Rewrites one streamed message: its text without the calls, the calls' parts beside it, and
        FINISH_REASON_TOOL_CALLS for an output that stopped after calling."""
        text, parts = self.feed(message.text)
        if message.finish_reason:
            text += self.finish()
            if self.num_calls and message.finish_reason == llm_pb2.FINISH_REASON_STOP:
                message.finish_reason = llm_pb2.FINISH_REASON_TOOL_CALLS
        message.text = text
        message.tool_calls.extend(parts)


def _json_string(literal: str) -> str | None:
    """The string a JSON string literal writes (None when it is not one)."""
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None
