"""Errors in OpenAI's shape and status, as the official client sees them."""
import httpx
import openai
import pytest

from tests.gateway.conftest import BLOCK_SIZE, NUM_KV_BLOCKS
from tests.gateway.gateway_process import running_gateway
from tests.services.processes import free_port


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


@pytest.mark.parametrize("params", [{"n": 2}, {"stop": ["."]}, {"top_p": 0.5}, {"logprobs": 2},
                                    {"presence_penalty": 0.5}, {"frequency_penalty": 1.0}, {"best_of": 3},
                                    {"echo": True}, {"extra_body": {"top_k": 5}}])
def test_parameters_not_supported_yet_are_400_naming_them(oai, model_name, params):
    name = next(iter(params.get("extra_body", params)))
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=model_name, prompt="hi", max_tokens=2, **params)
    error = error_of(raised)
    assert error["param"] == name and "not supported" in error["message"]


@pytest.mark.parametrize("params", [{"logprobs": True}, {"top_logprobs": 3}, {"stop": "x"}, {"n": 3}])
def test_chat_parameters_not_supported_yet_are_400(oai, model_name, params):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    **params)
    assert error_of(raised)["param"] == next(iter(params))


def test_neutral_values_of_unsupported_parameters_are_accepted(oai, model_name):
    got = oai.completions.create(model=model_name, prompt="hi", max_tokens=2, n=1, top_p=1.0, stop=[],
                                 presence_penalty=0.0, frequency_penalty=0.0)
    assert got.usage.completion_tokens <= 2


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
