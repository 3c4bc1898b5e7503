"""The grammar engine's view of a model's vocabulary (llguidance.LLTokenizer), which the scheduler
(to check a grammar against the special tokens it names) and the sampling rank (to turn a grammar
state into a token mask) both build from the checkpoint's tokenizer.json, for the model's vocabulary
size (its embedding rows, often more than the tokenizer's ids) and its eos ids: the mask of a
complete grammar allows exactly the tokens the scheduler stops at.

Building one reads every token's bytes (~1 s on a server core, several on a busy small machine),
so it is built once, on first use, by whichever thread needs it first; the others wait for it."""
import threading
from pathlib import Path

import llguidance


class GrammarTokenizer:
    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_file, self.vocab_size, self.eos_token_ids = tokenizer_file, vocab_size, eos_token_ids
        self._built: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None:
                self._built = llguidance.LLTokenizer(self.tokenizer_file.read_text(), n_vocab=self.vocab_size,
                                                     eos_token=list(self.eos_token_ids))
            return self._built
