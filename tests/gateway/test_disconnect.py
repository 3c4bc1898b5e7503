"""A client that goes away cancels its gRPC call: the scheduler frees the request's KV blocks."""
import httpx

from tests.services.processes import wait_idle

PROMPT = [(i * 31 + 7) % 140000 for i in range(100)]  # 7 blocks of 16
LONG = 3000  # tokens: a minute of CPU decoding, far longer than the waits below


def test_leaving_mid_stream_frees_the_blocks(gateway, grpc_client, model_name):
    before = wait_idle(grpc_client)  # the folder's server: an earlier test's requests may still be ending
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=60) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        during = grpc_client.stats()
        assert during.num_running == 1 and during.kv_blocks_free <= during.kv_blocks_total - 7
    after = wait_idle(grpc_client)
    assert after.generated_tokens_total - before.generated_tokens_total < LONG


def test_leaving_a_whole_response_request_frees_the_blocks(gateway, grpc_client, model_name):
    before = wait_idle(grpc_client)
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    try:
        httpx.post(gateway + "/v1/completions", json=body, timeout=1.0)
        raise AssertionError("the request should still be generating")
    except httpx.ReadTimeout:
        pass  # the client gives up and closes the connection
    after = wait_idle(grpc_client)
    assert after.generated_tokens_total - before.generated_tokens_total < LONG
