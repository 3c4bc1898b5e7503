"""The model's sampling defaults (its generation_config.json, reported by the workers) fill what a request
leaves unset, as vLLM does; what the request sets wins, 0 (greedy) included."""
import pytest

from nanoserve.v1 import llm_pb2, worker_pb2
from scheduler_svc.request_validation import BadRequest, RequestLimits, sampling_options

LIMITS = RequestLimits(vocab_size=1000, max_model_len=64, max_n=4, max_logprobs=5)


def options(defaults: worker_pb2.SamplingDefaults | None, **request):
    return sampling_options(llm_pb2.SamplingParams(**request), LIMITS, defaults)


def temperature(defaults: worker_pb2.SamplingDefaults | None, **request) -> float:
    return options(defaults, **request).temperature


def test_an_unset_temperature_is_the_models_default():
    model = worker_pb2.SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert temperature(model) == pytest.approx(0.6)
    assert temperature(model, temperature=0.0) == 0.0
    assert temperature(model, temperature=1.3) == pytest.approx(1.3)


def test_without_a_model_default_the_api_default_applies():
    assert temperature(None) == temperature(worker_pb2.SamplingDefaults(top_k=5)) == 1.0


def test_a_default_does_not_excuse_a_bad_request():
    with pytest.raises(BadRequest, match="temperature must be a number >= 0"):
        temperature(worker_pb2.SamplingDefaults(temperature=0.6), temperature=-1.0)


def test_unset_top_p_and_top_k_are_the_models_too():
    model = worker_pb2.SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert (options(model).top_p, options(model).top_k) == (pytest.approx(0.95), 20)
    assert (options(model, top_p=1.0, top_k=-1).top_p, options(model, top_k=-1).top_k) == (1.0, 0)
    assert (options(None).top_p, options(None).top_k) == (1.0, 0)
