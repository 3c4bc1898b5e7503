"""Text <-> token ids for the scheduler, on the light `tokenizers` library (no transformers, no torch)."""
import json
from pathlib import Path

from tokenizers import Tokenizer

from nanoserve.hub import resolve_model_dir
from scheduler_svc.detokenizer import IncrementalDetokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class TextTokenizer:
    """A checkpoint's tokenizer: `tokenizer.json`, plus `tokenizer_config.json` when present. The model is
    a directory or a Hugging Face Hub id, resolved as the workers resolve it (nanoserve.hub)."""

    def __init__(self, model: str | Path, revision: str = "", download_dir: str = "") -> None:
        model_dir = self.directory = resolve_model_dir(str(model), TOKENIZER_FILES, revision, download_dir)
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._bos_ids = self._required_bos_ids(model_dir / "tokenizer_config.json")
        self._token_texts: dict[int, str] = {}

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Prompt ids: the text's tokens, after a BOS only if the tokenizer config asks for one
        (add_bos False: never, e.g. for a chat template's text, which writes its own)."""
        # encode_batch lets go of the GIL while it works (encode does not): a long text tokenized on
        # the server's tokenizer thread leaves the engine's event loop running.
        return self._bos_ids * add_bos + self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of the ids; special tokens (eos, chat markers) are left out unless asked for,
        as when streaming."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens included (as logprobs show them)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def new_detokenizer(self) -> IncrementalDetokenizer:
        """A streaming decoder for one sequence, consistent with `decode`."""
        return IncrementalDetokenizer(self.decode)

    def _required_bos_ids(self, config_path: Path) -> list[int]:
        """[bos id] when the config sets `add_bos_token` (Llama style); Qwen3 sets it false."""
        if not config_path.exists():
            return []
        config = json.loads(config_path.read_text())
        bos = config.get("bos_token")
        if not config.get("add_bos_token") or bos is None:
            return []
        bos_content = bos["content"] if isinstance(bos, dict) else bos  # older configs nest it
        bos_id = self._tokenizer.token_to_id(bos_content)
        if bos_id is None:
            raise ValueError(f"{config_path}: bos_token {bos_content!r} is not in the vocabulary")
        return [bos_id]
