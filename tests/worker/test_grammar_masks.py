"""The sampling rank's grammar masks, filled ahead on their mask thread: each step's masked logits keep
exactly the tokens a fresh llguidance matcher fed the same tokens allows (the oracle), also when a
slot is handed to a new sequence of another grammar while the old one's drawn tokens are still on
their way to its matcher; both where the logits are masked in place and where the masks go to the
sampler's draw (applied here by the reference the race kernel is tested against)."""
import json
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch
from llguidance.numpy import fill_next_token_bitmask

from nanoserve.grammar_tokenizer import GrammarTokenizer
from scheduler_svc.structured_outputs import GrammarCompiler
from nanoserve_kernels.token_bitmask import masked_copy
from worker_svc.grammar_masks import GrammarMasks

VOCAB, EOS = 151936, (151645,)
DIGITS = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
WORDS = {"enum": ["alpha", "beta"]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> GrammarTokenizer:
    return GrammarTokenizer(Path(tiny_model_dir) / "tokenizer.json", VOCAB, EOS)


def allowed_by_oracle(tokenizer: GrammarTokenizer, grammar: str, tokens: list[int]) -> np.ndarray:
    matcher = llguidance.LLMatcher(tokenizer.get(), grammar)
    assert matcher.consume_tokens(tokens)
    bitmask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
    fill_next_token_bitmask(matcher, bitmask)
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


def grammar_masks(capacity: int, tokenizer: GrammarTokenizer) -> GrammarMasks:
    """GrammarMasks on the CPU, with a table of its own standing for the device's copy: each fill must
    copy its rows there for the masks to reach a draw. Made under inference mode, as the runner makes
    them, though the fills run on other threads, outside it; the stand-in table, like the real ones, is a
    plain tensor that those threads may write."""
    with torch.inference_mode():
        masks = GrammarMasks(capacity, tokenizer, torch.device("cpu"))
    with torch.inference_mode(False):
        masks.device_table = torch.zeros_like(masks.host_table)
        masks.row_pairs = list(zip(masks.device_table.unbind(0), masks.host_table.unbind(0)))
    return masks


def masked_step(masks: GrammarMasks, slots: list[int], draw: list[int], in_place: bool = True,
                reply_advances: bool = False) -> np.ndarray:
    """One step sampling `slots`: the rows each mask keeps; then `draw` is observed, and the matchers'
    advance run at once, as the step's reply runs it, or left to the next masked step (or first mask)."""
    logits = torch.zeros(len(slots), VOCAB)
    slots_array = np.array(slots)
    rows = masks.constrained_rows(slots_array)
    if in_place:
        masks.mask(logits, slots_array, rows, torch.from_numpy(slots_array))
    else:
        logits = masked_copy(logits, masks.draw_masks(slots_array, rows, torch.from_numpy(slots_array)))
    advance = masks.observe(torch.tensor(draw), None, slots_array, rows)
    if reply_advances:
        advance()
    return torch.isfinite(logits).numpy()


# Where the masks go (masked in place, or to the draw), and who advances the matchers after a step.
IN_PLACE = pytest.mark.parametrize("in_place", [True, False], ids=["in place", "in the draw"])
REPLY = pytest.mark.parametrize("reply_advances", [True, False], ids=["by the reply", "by the next step"])


@IN_PLACE
@REPLY
def test_masks_follow_each_sequence_and_a_reused_slot(tokenizer, in_place, reply_advances):
    """Each slot's mask is its own sequence's, resumed or fresh, and a reused slot's is the new one's."""
    compiler = GrammarCompiler(tokenizer)
    digits, words = compiler.compile("json", json.dumps(DIGITS)), compiler.compile("json", json.dumps(WORDS))
    text = tokenizer.get()
    masks = grammar_masks(4, tokenizer)
    opening, one = text.tokenize_str('{"n": '), text.tokenize_str("1")
    masks.reset(0, digits, opening)  # resumed: it has already drawn the object's opening
    masks.reset(2, words, [])
    masks.fill_first_masks()
    kept = masked_step(masks, [0, 2], [one[0], text.tokenize_str('"alpha"')[0]], in_place, reply_advances)
    assert (kept[0] == allowed_by_oracle(tokenizer, digits, opening)).all()
    assert (kept[1] == allowed_by_oracle(tokenizer, words, [])).all()
    # slot 0 goes to a sequence of the other grammar before its last draw has reached the old matcher
    masks.reset(0, words, [])
    masks.fill_first_masks()
    kept = masked_step(masks, [2, 0], [0, 0], in_place, reply_advances)
    assert (kept[0] == allowed_by_oracle(tokenizer, words, text.tokenize_str('"alpha"')[:1])).all()
    assert (kept[1] == allowed_by_oracle(tokenizer, words, [])).all()
    assert kept[1].sum() < VOCAB and (kept[1] != allowed_by_oracle(tokenizer, digits, opening + one[:1])).any()


@IN_PLACE
@REPLY
def test_unconstrained_rows_between_constrained_ones(tokenizer, in_place, reply_advances):
    """A step that samples an unconstrained row between two constrained ones: that row keeps every
    token, and each matcher moves on by its own row's draw."""
    digits = GrammarCompiler(tokenizer).compile("json", json.dumps(DIGITS))
    text = tokenizer.get()
    opening, one, two, close = (text.tokenize_str(t) for t in ('{"n": ', "1", "2", "}"))
    masks = grammar_masks(3, tokenizer)
    masks.reset(0, digits, opening + one)
    masks.reset(2, digits, opening)
    masks.fill_first_masks()
    # the unconstrained row's draw would break either grammar
    masked_step(masks, [0, 1, 2], [close[0], text.tokenize_str(" hello")[0], two[0]], in_place, reply_advances)
    kept = masked_step(masks, [0, 1, 2], [0, 0, 0], in_place, reply_advances)
    assert (kept[0] == allowed_by_oracle(tokenizer, digits, opening + one + close)).all()
    assert kept[1].all()
    assert (kept[2] == allowed_by_oracle(tokenizer, digits, opening + two)).all()
    assert (kept[0] != kept[2]).any()


def test_a_run_of_masked_steps_is_logged_with_its_split(tokenizer, caplog):
    """Each run of masked steps ends in one log line: its steps, rows and the time split per step."""
    grammar = GrammarCompiler(tokenizer).compile("json", json.dumps(DIGITS))
    masks = grammar_masks(3, tokenizer)
    masks.reset(1, grammar, [])
    masks.reset(2, grammar, [])
    masks.fill_first_masks()
    opening = tokenizer.get().tokenize_str('{"n": ')
    with caplog.at_level("INFO", logger="nanoserve.worker"):
        for token in opening[:3]:
            masked_step(masks, [0, 1, 2], [0, token, token])
        masks.unmasked_step()
        masks.unmasked_step()  # no run to end: nothing more
    lines = [record.getMessage() for record in caplog.records if "grammar masks" in record.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("grammar masks over 3 steps (6 rows), ms a step: ")
    parts = dict(part.split("=") for part in lines[0].split(": ")[1].split())
    assert set(parts) == {"tokens_wait", "consume", "fill", "first", "launcher_wait", "queue"}
    assert all(float(value) >= 0 for value in parts.values()) and float(parts["fill"]) > 0
