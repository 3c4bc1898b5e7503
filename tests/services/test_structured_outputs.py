"""structured_outputs through real processes on CPU (issue 40): outputs that end with stop are what
the constraint asks for (JSON validated by `jsonschema`, regexes by `re`, choices by membership);
outputs cut by max_tokens are prefixes llguidance accepts; greedy constrained decoding equals
transformers' with llguidance's mask applied to its logits, token for token; the masks come before
logprobs and other processors that read the logits, and inside the draw otherwise; a property test over
generated schemas; constraints that cannot compile are INVALID_ARGUMENT naming what is wrong; a
worker killed while constrained requests stream leaves their outputs as an undisturbed run's."""
import json
import os
import re
import signal
import threading
from pathlib import Path

import grpc
import jsonschema
import llguidance
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
from transformers import AutoModelForCausalLM

from nanoserve.client import Client
from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve.v1 import llm_pb2
from scheduler_svc.structured_outputs import JSON_DEFAULTS
from tests.services.processes import running_service
from tests.services.test_recovery import Up

PROMPT = "Describe a person as JSON:"
EOS_IDS = (151645, 151643)  # the demo model's generation_config eos ids
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]}, "tags": {"type": "array", "items": {"type": "boolean"},
                                                          "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "services.log"
    flags = ("--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "16")
    with running_service(Path(tiny_model_dir), log, worker_flags=flags) as svc, Client(svc["address"]) as c:
        yield c


@pytest.fixture(scope="module")
def grammar_tokenizer(tiny_model_dir):
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    return GrammarTokenizer(Path(tiny_model_dir) / "tokenizer.json", config["vocab_size"], EOS_IDS).get()


def json_schema(schema: dict) -> llm_pb2.StructuredOutputs:
    return llm_pb2.StructuredOutputs(json=json.dumps(schema))


def schema_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS)


def check_json_outputs(completions, schema: dict, tokenizer) -> int:
    """Each completion: stop -> valid JSON of the schema; length -> a prefix the grammar accepts.
    Returns how many stopped."""
    stopped = 0
    for completion in completions:
        if completion.finish_reason == "FINISH_REASON_STOP":
            jsonschema.validate(json.loads(completion.text), schema)
            stopped += 1
        else:
            assert completion.finish_reason == "FINISH_REASON_LENGTH"
            matcher = llguidance.LLMatcher(tokenizer, schema_grammar(schema))
            assert matcher.validate_tokens(completion.token_ids) == len(completion.token_ids), completion.text
    return stopped


def test_json_schema_outputs_that_stop_validate(client, grammar_tokenizer):
    completions = [client.generate(PROMPT, max_tokens=80, temperature=0, structured_outputs=json_schema(PERSON))]
    completions += client.generate_n(PROMPT, n=8, max_tokens=80, temperature=1.0, seed=7,
                                     structured_outputs=json_schema(PERSON))
    assert check_json_outputs(completions, PERSON, grammar_tokenizer) >= 1


def test_json_object_regex_choice_and_grammar(client):
    obj = client.generate(PROMPT, max_tokens=64, temperature=0, seed=1,
                          structured_outputs=llm_pb2.StructuredOutputs(json_object=True))
    if obj.finish_reason == "FINISH_REASON_STOP":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    regex = client.generate_n(PROMPT, n=4, max_tokens=32, temperature=1.0, seed=3,
                              structured_outputs=llm_pb2.StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"))
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text) for c in regex), [c.text for c in regex]
    choices = ["yes", "no", "maybe so"]
    chosen = client.generate_n(PROMPT, n=6, max_tokens=8, temperature=1.0, seed=5,
                               structured_outputs=llm_pb2.StructuredOutputs(choice=llm_pb2.ChoiceList(choices=choices)))
    assert all(c.text in choices and c.finish_reason == "FINISH_REASON_STOP" for c in chosen)
    ebnf = 'root ::= "(" digits ("+" digits)* ")"\ndigits ::= [0-9]+'
    sums = client.generate_n(PROMPT, n=4, max_tokens=40, temperature=1.0, seed=9,
                             structured_outputs=llm_pb2.StructuredOutputs(grammar=ebnf))
    for c in sums:
        pattern = r"\([0-9]+(\+[0-9]+)*\)" if c.finish_reason == "FINISH_REASON_STOP" else r"\([0-9+]*"
        assert re.fullmatch(pattern, c.text), c.text


def test_a_complete_grammar_stops_even_with_ignore_eos(client):
    done = client.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True,
                           structured_outputs=llm_pb2.StructuredOutputs(regex="(ab|cd)"))
    assert (done.text, done.finish_reason) in {("ab", "FINISH_REASON_STOP"), ("cd", "FINISH_REASON_STOP")}


def test_greedy_tokens_equal_transformers_with_llguidance_masks(client, tiny_model_dir, grammar_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = client.tokenize(PROMPT)
    matcher = llguidance.LLMatcher(grammar_tokenizer, schema_grammar(PERSON))
    bitmask = allocate_token_bitmask(1, grammar_tokenizer.vocab_size)
    want: list[int] = []
    for _ in range(48):
        with torch.no_grad():
            logits = model(torch.tensor([ids + want])).logits[0, -1:].numpy().copy()
        fill_next_token_bitmask(matcher, bitmask)
        apply_token_bitmask_inplace(logits, bitmask)
        want.append(int(logits.argmax()))
        if want[-1] in EOS_IDS:
            break
        assert matcher.consume_token(want[-1])
    got = client.generate(ids, max_tokens=48, temperature=0, structured_outputs=json_schema(PERSON))
    assert want[-1] in EOS_IDS and got.finish_reason == "FINISH_REASON_STOP"  # the grammar ended it
    assert got.token_ids == want  # eos included, as the API reports it


def test_constrained_and_plain_requests_share_steps(client):
    """Run together (their rows masked or not in the same steps), each gives what it gives alone."""
    asks = [dict(max_tokens=24, temperature=0, ignore_eos=True)] * 2 + \
           [dict(max_tokens=48, temperature=0, structured_outputs=json_schema(PERSON))] * 2
    prompts = [PROMPT + " " * i for i in range(len(asks))]
    alone = [client.generate(prompt, **ask).token_ids for prompt, ask in zip(prompts, asks)]
    together: list = [None] * len(asks)

    def run(i: int) -> None:
        together[i] = client.generate(prompts[i], **asks[i]).token_ids
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert together == alone


def test_masks_come_first_where_logprobs_or_processors_read_the_logits(client, grammar_tokenizer):
    """A constrained request that asks for logprobs (or top-k) has its logits masked before they are read,
    one that asks for neither has its masks read inside the draw: the same greedy tokens either way, each
    scored against the masked logits (every alternative with a finite logprob one the grammar allows
    there, the token itself first), and sampled top-k outputs as valid as any."""
    greedy = dict(max_tokens=32, temperature=0, structured_outputs=json_schema(PERSON))
    drawn, scored = client.generate(PROMPT, **greedy), client.generate(PROMPT, logprobs=3, **greedy)
    assert scored.token_ids == drawn.token_ids and len(scored.logprobs) == len(drawn.token_ids)
    matcher = llguidance.LLMatcher(grammar_tokenizer, schema_grammar(PERSON))
    bitmask = allocate_token_bitmask(1, grammar_tokenizer.vocab_size)
    for token, row in zip(scored.token_ids, scored.logprobs):
        fill_next_token_bitmask(matcher, bitmask)
        alternatives = [alt.token_id for alt in row.top if np.isfinite(alt.logprob)]
        assert alternatives[0] == token and all((bitmask[0, t // 32] >> (t % 32)) & 1 for t in alternatives)
        if token not in EOS_IDS:
            assert matcher.consume_token(token)
    top_k = client.generate_n(PROMPT, n=2, max_tokens=48, temperature=1.0, top_k=5, seed=11,
                              structured_outputs=json_schema(PERSON))
    check_json_outputs(top_k, PERSON, grammar_tokenizer)


@st.composite
def schemas(draw, depth: int = 2):
    """Small schemas whose every value is bounded: strings, numbers, enums, arrays and objects."""
    leaves = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
        st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 50}, st.integers(-20, 20)),
        st.just({"type": "boolean"}),
        st.builds(lambda xs: {"enum": xs}, st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1,
                                                    max_size=3, unique=True)))
    if depth == 0:
        return draw(leaves)
    child = schemas(depth=depth - 1)
    return draw(st.one_of(
        leaves,
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, child, st.integers(1, 3)),
        st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                 "additionalProperties": False},
                  st.dictionaries(st.sampled_from(["a", "b", "id", "x_1"]), child, min_size=1, max_size=3))))


@settings(max_examples=8, deadline=None)
@given(schema=schemas(), seed=st.integers(0, 2**32 - 1))
def test_generated_schemas_hold(client, grammar_tokenizer, schema, seed):
    completions = client.generate_n(PROMPT, n=2, max_tokens=48, temperature=1.0, seed=seed,
                                    structured_outputs=json_schema(schema))
    check_json_outputs(completions, schema, grammar_tokenizer)


@pytest.mark.parametrize("constraint, sampling, message", [
    (dict(json='{"type": "frobnicate"}'), {}, "structured_outputs.json: Invalid type: frobnicate"),
    (dict(json='{"type": "object", "if": {"required": ["a"]}}'), {}, 'Unimplemented keys: ["if"]'),
    (dict(json='{"type": '), {}, "structured_outputs.json is not valid JSON"),
    (dict(regex="a(b"), {}, "unclosed group"),
    (dict(choice=llm_pb2.ChoiceList()), {}, "choice must list at least one string"),
    (dict(grammar="start: nowhere"), {}, "structured_outputs.grammar"),
    (dict(structural_tag='{"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<b"]}'), {},
     "starts with none of the triggers"),
    (dict(json_object=True), {"min_tokens": 2}, "min_tokens cannot be combined with structured_outputs"),
])
def test_constraints_that_cannot_compile_are_invalid_arguments(client, constraint, sampling, message):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(PROMPT, max_tokens=4, structured_outputs=llm_pb2.StructuredOutputs(**constraint), **sampling)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


def test_a_killed_worker_leaves_constrained_outputs_as_an_undisturbed_run(tiny_model_dir, tmp_path):
    """Rank 0 is killed while 6 constrained requests stream: the restarted worker rebuilds each grammar
    from the tokens the scheduler resends, and every output equals the undisturbed run's."""
    up = Up(tiny_model_dir, tmp_path / "up.log")
    try:
        def run_all(kill: bool) -> list[list[int]]:
            outputs: list[list[int]] = [[] for _ in range(6)]
            started = [threading.Event() for _ in range(6)]

            def stream(i: int) -> None:
                with Client(up.address) as c:
                    for message in c.stream(PROMPT + " " * i, timeout=300, max_tokens=40, temperature=0.9,
                                            seed=100 + i, structured_outputs=json_schema(PERSON)):
                        outputs[i] += message.token_ids
                        started[i].set()
            threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
            for thread in threads:
                thread.start()
            for event in started:  # every stream has tokens: the grammars are mid-way
                assert event.wait(timeout=300)
            if kill:
                os.kill(up.workers()[0], signal.SIGKILL)
            for thread in threads:
                thread.join(timeout=300)
            return outputs

        undisturbed = run_all(kill=False)
        assert run_all(kill=True) == undisturbed
        assert "restarting the worker group" in (tmp_path / "up.log").read_text()
    finally:
        up.stop()
