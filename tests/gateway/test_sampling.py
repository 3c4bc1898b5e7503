"""Issue 18's sampling controls through the gateway: each one, on /v1/completions and
/v1/chat/completions, whole and streamed, gives what the same request gives over gRPC (whose
tests check the scheduler against transformers), and changes what the request gives without it."""
import pytest

from tests.gateway.answers import ask

PROMPT = "The sea is calm tonight, and the"
MESSAGES = [{"role": "user", "content": "Write about the sea."}]
SAMPLED = {"temperature": 1.0, "seed": 11}
GREEDY = {"temperature": 0}


def cases(grpc_client) -> dict[str, tuple[dict, dict]]:
    """Case -> (its OpenAI parameters, the same as gRPC SamplingParams); each on top of `max_tokens` 12."""
    favourite = grpc_client.tokenize(" blue")[0]
    first_greedy = grpc_client.generate(PROMPT, max_tokens=1, temperature=0).token_ids[0]
    same = {
        "top_p": {**SAMPLED, "top_p": 0.05}, "top_k": {**SAMPLED, "top_k": 3}, "min_p": {**SAMPLED, "min_p": 0.2},
        "seed": {"temperature": 1.0, "seed": 12345},
        # The tiny model never repeats itself unasked: a repetition_penalty below 1 makes it, and the
        # presence and frequency penalties then show.
        "repetition_penalty": {**GREEDY, "repetition_penalty": 0.3},
        "presence_penalty": {**GREEDY, "repetition_penalty": 0.6, "presence_penalty": 2.0},
        "frequency_penalty": {**GREEDY, "repetition_penalty": 0.6, "frequency_penalty": 2.0},
        "min_tokens": {**GREEDY, "stop_token_ids": [first_greedy], "min_tokens": 5},
    }
    pairs = {name: (params, params) for name, params in same.items()}
    pairs["logit_bias"] = ({**GREEDY, "logit_bias": {str(favourite): 100}},
                           {**GREEDY, "logit_bias": {favourite: 100.0}})
    return pairs


CASES = ["top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
         "min_tokens", "logit_bias"]


def without_the_control(case: str, params: dict) -> dict:
    """The case's request without its control (a seed case: with another seed)."""
    if case == "seed":
        return {**params, "seed": 54321}
    return {k: v for k, v in params.items() if k != case}


@pytest.fixture(scope="module")
def pairs(grpc_client):
    return cases(grpc_client)


@pytest.mark.parametrize("case", CASES)
def test_each_control_changes_what_grpc_gives(grpc_client, pairs, case):
    """So the comparisons below could fail: without the control, the tokens differ."""
    _, sampling = pairs[case]
    with_it = grpc_client.generate(PROMPT, max_tokens=12, ignore_eos=case != "min_tokens", **sampling)
    without = grpc_client.generate(PROMPT, max_tokens=12, ignore_eos=case != "min_tokens",
                                   **without_the_control(case, sampling))
    assert with_it.token_ids != without.token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", CASES)
def test_completions_carry_each_control(oai, grpc_client, model_name, pairs, case, stream):
    params, sampling = pairs[case]
    ignore_eos = case != "min_tokens"
    want = grpc_client.generate(PROMPT, max_tokens=12, ignore_eos=ignore_eos, **sampling)
    got = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, max_tokens=12, ignore_eos=ignore_eos,
              **params)
    assert got.texts == [want.text]
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.choices[0].finish_reason == {"FINISH_REASON_STOP": "stop", "FINISH_REASON_LENGTH": "length"}[
        want.finish_reason]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", CASES)
def test_chat_carries_each_control(oai, grpc_client, model_name, pairs, case, stream):
    params, sampling = pairs[case]
    ignore_eos = case != "min_tokens"
    want = grpc_client.chat(MESSAGES, max_tokens=12, ignore_eos=ignore_eos, **sampling)
    got = ask(oai, "chat", stream, model=model_name, messages=MESSAGES, max_completion_tokens=12,
              ignore_eos=ignore_eos, **params)
    assert got.texts == [want.text]
    assert got.usage.completion_tokens == len(want.token_ids)
