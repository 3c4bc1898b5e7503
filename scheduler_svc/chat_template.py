"""A model's chat template (from its tokenizer files), rendered with jinja2 the way transformers'
`apply_chat_template` renders it, without transformers: a conversation in, the prompt text out."""
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The model has no template, or its template refuses the conversation; says which."""


class ChatTemplate:
    """The template of a checkpoint (or tokenizer) directory, loaded on first use."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._template: jinja2.Template | None = None
        self._special_tokens: dict[str, str] = {}
        self._thinks = False  # the template has Qwen3's enable_thinking switch

    def thinking(self, prompt: str) -> str:
        """Whether the model reasons before it answers a prompt this template wrote: "open" (it
        will open its <think> block itself), "opened" (the prompt opened it) or "" (no reasoning:
        the template has no switch for it, or closed an empty block because the switch is off)."""
        end = prompt.rstrip()
        if end.endswith("</think>"):
            return ""
        if end.endswith("<think>"):
            return "opened"
        return "open" if self._thinks else ""

    def render(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
        """The prompt text of a conversation, as the model's own chat template writes it."""
        if self._template is None:
            self._template, self._special_tokens = self._load()
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._special_tokens, **template_kwargs)
        except jinja2.TemplateError as err:  # raise_exception() in the template: a bad conversation
            raise ChatTemplateError(f"the chat template rejects these messages: {err}") from None

    def _load(self) -> tuple[jinja2.Template, dict[str, str]]:
        config_path = self.directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        jinja_file = self.directory / "chat_template.jinja"  # where newer transformers save it
        if jinja_file.exists():
            source = jinja_file.read_text()
        if not source:
            raise ChatTemplateError(f"the model at {self.directory} has no chat template (in tokenizer_config.json "
                                    "or chat_template.jinja); send the prompt text to Generate instead")
        special = {name: value["content"] if isinstance(value, dict) else value
                   for name in _SPECIAL_TOKENS if (value := config.get(name)) is not None}
        self._thinks = "enable_thinking" in source
        return _environment().from_string(source), special


def _environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 setup transformers gives chat templates: sandboxed, trimmed blocks, loop
    controls, and the helpers templates call (tojson keeps non-ASCII, raise_exception)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
