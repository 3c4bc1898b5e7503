"""A request's structured_outputs (llm.proto) -> the grammar the sampling rank enforces, in
llguidance's format, checked against the model's vocabulary before the request is queued: a
constraint that does not compile, or that uses a JSON-schema keyword llguidance would ignore, is
refused naming what is wrong. Compiled grammars are cached by their text (the same schema sent
again costs a dictionary lookup); the work runs on the server's tokenizer threads, off the engine
loop."""
import functools
import json

from llguidance import LLMatcher, StructTag, grammar_from

from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve.v1 import llm_pb2

# Distinct constraints whose grammar is kept (a grammar is a few KB of text).
GRAMMAR_CACHE_SIZE = 1024
# JSON is written on one line, as Python's json.dumps writes it (", " and ": " between items, no other
# whitespace), unless the schema's "x-guidance" says otherwise: free whitespace lets a model pad its
# output until it runs out of tokens.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The reasoning a thinking model writes before its answer: text up to its end-of-thinking token.
_THINKING = 'THINKING: /(.|\\n)*/\n'


class ConstraintError(Exception):
    """A constraint that cannot be enforced; the message names the field and the problem."""


def constraint_key(constraints: llm_pb2.StructuredOutputs) -> tuple[str, object] | None:
    """(kind, value) of the request's constraint, hashable; None when it sets none."""
    kind = constraints.WhichOneof("kind")
    if kind is None:
        return None
    value = getattr(constraints, kind)
    return kind, tuple(value.choices) if kind == "choice" else value


def _grammar(kind: str, value) -> str:
    """The llguidance grammar of one constraint (not yet checked against a vocabulary)."""
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(_json(kind, value, (dict, bool)), JSON_DEFAULTS)
    if kind == "json_object":
        if not value:
            raise ConstraintError("structured_outputs.json_object must be true when set")
        return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_DEFAULTS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not value:
            raise ConstraintError("structured_outputs.choice must list at least one string")
        return grammar_from("choice", list(value))
    if kind == "grammar":
        try:
            return grammar_from("grammar", value)
        except ValueError as err:
            raise ConstraintError(f"structured_outputs.grammar: {err}") from None
    return _structural_tag(_json(kind, value, (dict,)))


def _json(kind: str, text: str, types: tuple[type, ...]):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConstraintError(f"structured_outputs.{kind} is not valid JSON: {err}") from None
    if not isinstance(value, types):
        raise ConstraintError(f"structured_outputs.{kind} must be a JSON object, got {type(value).__name__}")
    return value


def _structural_tag(spec: dict) -> str:
    """vLLM's structural_tag: each structure opens at its begin, which starts with one of the triggers."""
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not structures or not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
        raise ConstraintError("structured_outputs.structural_tag needs non-empty `structures` and `triggers` lists")
    tags = []
    for i, structure in enumerate(structures):
        begin = structure.get("begin") if isinstance(structure, dict) else None
        if not isinstance(begin, str) or not isinstance(structure.get("end", ""), str):
            raise ConstraintError(f"structured_outputs.structural_tag: structures[{i}] needs `begin` and `end` strings")
        trigger = next((t for t in triggers if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise ConstraintError(f"structured_outputs.structural_tag: structures[{i}].begin {begin!r} starts "
                                  "with none of the triggers")
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=structure.get("schema", {}),
                              end=structure.get("end", "")))
    return StructTag.to_grammar(tags)


def after_thinking(grammar: str, opened: bool) -> str:
    """The grammar of an answer that follows the model's reasoning: free text up to the
    end-of-thinking token (after the opening token unless the prompt `opened` it), then `grammar`."""
    parts = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    answer = {**parts[0], "name": "answer"}
    opening = "" if opened else "<think> "
    top = f"start: {opening}THINKING </think> /[ \\t\\n]*/ @answer\n{_THINKING}"
    return json.dumps({"grammars": [{"lark_grammar": top}, answer, *parts[1:]]})


class GrammarCompiler:
    """Turns constraints into checked grammars for one model's vocabulary."""

    def __init__(self, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self.compile = functools.lru_cache(GRAMMAR_CACHE_SIZE)(self._compile)

    def _compile(self, kind: str, value, thinking: str = "") -> str:
        """`thinking`: "" (the answer starts at once), "open" (the model opens its reasoning
        itself) or "opened" (the prompt did)."""
        try:
            grammar = _grammar(kind, value)
        except (ValueError, TypeError, AssertionError) as err:  # llguidance's own refusals
            raise ConstraintError(f"structured_outputs.{kind}: {err}") from None
        if thinking:
            grammar = after_thinking(grammar, opened=thinking == "opened")
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer.get())
        if failed or messages:  # a warning is a part of the constraint that would not be enforced
            raise ConstraintError(f"structured_outputs.{kind}: {'; '.join(messages)}")
        return grammar
