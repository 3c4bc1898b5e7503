"""Errors in OpenAI's shape and status, as the official client sees them."""
import subprocess

import httpx
import openai
import pytest

from tests.gateway.conftest import BLOCK_SIZE, NUM_KV_BLOCKS
from tests.gateway.gateway_process import running_gateway
from tests.services.processes import CLI, ENV, free_port


def error_of(raised: pytest.ExceptionInfo) -> dict:
    return raised.value.response.json()["error"]


def test_bad_temperature_is_400_naming_it(oai, model_name):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=model_name, prompt="hi", temperature=-0.5)
    assert raised.value.status_code == 400
    error = error_of(raised)
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as raised:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert error_of(raised)["param"] == "model" and error_of(raised)["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("params, param, fragment", [
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"extra_body": {"top_k": -2}}, "top_k", "top_k must be -1 or 0 (off) or at least 1"),
    ({"extra_body": {"min_p": 2.0}}, "min_p", "min_p must be in [0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "repetition_penalty must be in > 0"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens", "min_tokens must be in [0, max_tokens = 2]"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias of token 5 must be in [-100, 100]"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias", "logit_bias: token id 10000000 is outside the vocabulary"),
    ({"logit_bias": {"the": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"stop": ["ok", ""]}, "stop", "stop strings must not be empty"),
    ({"n": 17}, "n", "n must be in [1, 16] (this server's --max-n), got 17"),
    ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20] (this server's --max-logprobs)"),
    ({"logprobs": 21, "echo": True}, "logprobs", "logprobs must be in [0, 20]"),
    ({"best_of": 3}, "best_of", "`best_of` must equal `n` (1)"),
    ({"suffix": "tail"}, "suffix", "not supported"),
])
def test_bad_values_are_400_naming_the_parameter(oai, model_name, params, param, fragment, stream):
    """The scheduler's own message (its field named as the request names it), or the gateway's for
    what the scheduler cannot do; a stream too is refused before it starts."""
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=model_name, prompt="hi", max_tokens=2, stream=stream, **params)
    error = error_of(raised)
    assert error["param"] == param and fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("params, param, fragment", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ({"top_logprobs": 3}, "top_logprobs", "`top_logprobs` needs `logprobs` set to true"),
    ({"max_completion_tokens": 3, "extra_body": {"min_tokens": 4}}, "min_tokens", "min_tokens must be in [0, max"),
    ({"stop": "x", "n": 17}, "n", "n must be in [1, 16]"), ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be text, json_object or json_schema"),
    ({"n": 2, "extra_body": {"best_of": 3}}, "best_of", "`best_of` must equal `n` (2)"),
    ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs", "not available when `stream`"),
    ({"extra_body": {"echo": True}}, "echo", "not supported"),
])
def test_bad_chat_values_are_400_naming_the_parameter(oai, model_name, params, param, fragment):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    **params)
    error = error_of(raised)
    assert error["param"] == param and fragment in error["message"], error


def test_neutral_values_are_accepted(oai, model_name):
    got = oai.completions.create(model=model_name, prompt="hi", max_tokens=2, n=1, best_of=1, top_p=1.0, stop=[],
                                 presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}, echo=False,
                                 extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0})
    assert got.usage.completion_tokens <= 2
    chat = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=False, tool_choice="none", response_format={"type": "text"})
    assert chat.choices[0].logprobs is None


def test_several_prompts_are_400_naming_prompt(oai, model_name):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=model_name, prompt=["one", "two"], max_tokens=2)
    assert error_of(raised)["param"] == "prompt" and "one request per prompt" in error_of(raised)["message"]


def test_schedulers_invalid_argument_is_400_with_its_message(oai, model_name):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=model_name, prompt=[999_999_999], max_tokens=2)
    assert "outside the vocabulary" in error_of(raised)["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_too_big_for_kv_memory_is_400(gateway, model_name, stream):
    """The served length limit is capped to what the KV pool holds for one sequence (issue 13),
    so a prompt over the pool is over the limit: a bad request, not a busy server."""
    too_long = [7] * (NUM_KV_BLOCKS * BLOCK_SIZE + 1)  # under the model's own limit, over the pool
    response = httpx.post(gateway + "/v1/completions", timeout=60,
                          json={"model": model_name, "prompt": too_long, "max_tokens": 1, "stream": stream})
    assert response.status_code == 400
    assert f"length limit is {NUM_KV_BLOCKS * BLOCK_SIZE}" in response.json()["error"]["message"]


def test_malformed_body_is_400_not_422(gateway):
    response = httpx.post(gateway + "/v1/completions", json={"max_tokens": 3}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


def test_a_body_that_is_not_json_is_400_naming_no_parameter(gateway):
    response = httpx.post(gateway + "/v1/completions", content=b'{"model": x}',
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "the request body is not valid JSON: Expecting value (at character 10)",
                                        "type": "invalid_request_error", "param": None, "code": "invalid_json"}


def test_unknown_paths_and_methods_are_openai_errors(gateway, oai):
    response = httpx.post(gateway + "/v1/complete", json={}, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"] == {"message": "Invalid URL (POST /v1/complete): the OpenAI API is under /v1 "
                                                   "(/v1/completions, /v1/chat/completions, /v1/models)",
                                        "type": "not_found_error", "param": None, "code": None}
    with pytest.raises(openai.NotFoundError) as raised:  # the official client reads it as an API error
        oai.post("/complete", body={}, cast_to=object)
    assert error_of(raised)["message"].startswith("Invalid URL (POST /v1/complete)")
    response = httpx.get(gateway + "/v1/completions", timeout=10)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"] == {"message": "Invalid method for URL (GET /v1/completions): use POST",
                                        "type": "invalid_request_error", "param": None, "code": None}


def test_a_grpc_client_pointed_at_the_gateway_is_told_so(gateway):
    address = gateway.removeprefix("http://")
    out = subprocess.run(CLI + ["info", "--address", address], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"error: {address} is the OpenAI HTTP gateway ({gateway}/v1), not the gRPC API: "
                                  "point --address at the scheduler (port 50051 unless it was given another)")


def test_without_a_scheduler_health_and_requests_are_503(tmp_path):
    nobody = f"127.0.0.1:{free_port()}"
    with running_gateway(nobody, tmp_path / "gateway.log") as url:
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and nobody in health.json()["error"]["message"]
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as raised:
                client.completions.create(model="any", prompt="hi")
        assert raised.value.status_code == 503


def test_health_is_200_while_the_scheduler_serves(gateway):
    assert httpx.get(gateway + "/health", timeout=10).status_code == 200
