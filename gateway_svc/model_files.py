"""What the gateway reads from the model's tokenizer files itself, until the scheduler's API
has it (issue 18's Chat and Detokenize RPCs replace this module): the chat template, rendered
with jinja2 the way transformers' `apply_chat_template` renders it, and token ids to text with
the `tokenizers` library. Neither needs torch or transformers."""
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway_svc.errors import OpenAIError, bad_request

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ModelFiles:
    """A checkpoint directory's tokenizer.json and chat template, loaded on first use."""

    def __init__(self, directory: str):
        self.directory = Path(directory)
        self._template: jinja2.Template | None = None
        self._special_tokens: dict[str, str] = {}
        self._tokenizer: Tokenizer | None = None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
        """The prompt text of a conversation, as the model's own chat template writes it."""
        if self._template is None:
            self._template, self._special_tokens = self._load_template()
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._special_tokens, **template_kwargs)
        except jinja2.TemplateError as err:  # raise_exception() in the template: a bad conversation
            raise bad_request(f"the chat template rejects these messages: {err}", "messages") from None

    def detokenize(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_file(str(self._existing("tokenizer.json")))
        vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", "tokens")
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def _load_template(self) -> tuple[jinja2.Template, dict[str, str]]:
        config = json.loads(self._existing("tokenizer_config.json").read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        jinja_file = self.directory / "chat_template.jinja"  # where newer transformers save it
        if jinja_file.exists():
            source = jinja_file.read_text()
        if not source:
            raise OpenAIError(400, f"the model at {self.directory} has no chat template; use /v1/completions",
                              "messages", "no_chat_template")
        special = {name: value["content"] if isinstance(value, dict) else value
                   for name in _SPECIAL_TOKENS if (value := config.get(name)) is not None}
        return _environment().from_string(source), special

    def _existing(self, name: str) -> Path:
        path = self.directory / name
        if not path.exists():
            raise OpenAIError(500, f"the gateway cannot read {path}: run it where the model directory is "
                                   f"readable, or point --tokenizer at a copy of its tokenizer files",
                              code="model_files_missing")
        return path


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
