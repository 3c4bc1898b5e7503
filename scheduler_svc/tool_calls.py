"""Tool calls out of a chat completion's streamed text, in the Hermes format Qwen3's template teaches:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them, after or without
text. Text is handed on as it comes, except what may be the start of a `<tool_call>` tag (held back
until it is or is not one) and the calls' markup; a call is handed on once its closing tag arrives.
A tagged body that is not a call (not JSON, no name) stays in the text, as written."""
import json
import uuid

from nanoserve.v1 import llm_pb2

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _held_back(text: str) -> int:
    """Length of the longest end of `text` that begins OPEN (it may continue into the tag)."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def parse_call(body: str) -> llm_pb2.ToolCall | None:
    """The call a tag's body writes, or None when it writes none."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return llm_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=call["name"], arguments=arguments)


class ToolCallParser:
    def __init__(self, resumed_text: str = ""):
        """`resumed_text`: a resumed completion's text, which its client has parsed already."""
        self.pending = ""     # text not handed on yet: a tag's possible start, or an open call's body
        self.in_call = False
        self.num_calls = 0
        self.feed(resumed_text)

    def feed(self, text: str) -> tuple[str, list[llm_pb2.ToolCall]]:
        """The text to show and the calls completed, of `text` added to what came before."""
        self.pending += text
        shown, calls = [], []
        while True:
            if self.in_call:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                body, self.pending, self.in_call = self.pending[:end], self.pending[end + len(CLOSE):], False
                call = parse_call(body)
                if call is None:
                    shown.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
            else:
                start = self.pending.find(OPEN)
                if start < 0:
                    keep = _held_back(self.pending)
                    shown.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                shown.append(self.pending[:start])
                self.pending, self.in_call = self.pending[start + len(OPEN):], True
        self.num_calls += len(calls)
        return self._shown(shown), calls

    def finish(self) -> str:
        """At the end of the output: what is still held back, as text (an unclosed call included)."""
        rest = (OPEN if self.in_call else "") + self.pending
        self.pending, self.in_call = "", False
        return self._shown([rest])

    def _shown(self, pieces: list[str]) -> str:
        """Once a call is made, the blank lines between and after calls are markup too."""
        text = "".join(pieces)
        return "" if self.num_calls and not text.strip() else text

    def apply(self, message: llm_pb2.GenerateResponse) -> None:
        """Rewrites one streamed message: its text without the calls, the calls beside it, and
        FINISH_REASON_TOOL_CALLS for an output that stopped after calling."""
        text, calls = self.feed(message.text)
        if message.finish_reason:
            text += self.finish()
            if self.num_calls and message.finish_reason == llm_pb2.FINISH_REASON_STOP:
                message.finish_reason = llm_pb2.FINISH_REASON_TOOL_CALLS
        message.text = text
        message.tool_calls.extend(calls)
