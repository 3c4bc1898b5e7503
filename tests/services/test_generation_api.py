"""Issue 18's API through real processes on CPU, with transformers as the oracle: sampling controls,
penalties, logit_bias and min_tokens, stop strings, logprobs, n completions, Chat, Detokenize,
deadlines and the errors of bad values."""
import json
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

from nanoserve_model.logits_processors import ProcessorParams
from nanoserve.client import Client
from nanoserve.v1 import llm_pb2
from tests.services.processes import CLI, ENV, REPO, running_service
from tests.worker.test_logits_processors import hf_row

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 200
MAX_N = 16
PROMPT = "The sea is calm tonight, and the"


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("api") / "services.log"
    # A small token budget: long prompts are prefilled in chunks (prompt logprobs cross them).
    flags = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "32",
             "--max-num-batched-tokens", "64")
    with running_service(Path(tiny_model_dir), log, worker_flags=flags,
                         scheduler_flags=("--max-n", str(MAX_N))) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service):
    with Client(service["address"]) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_model_dir))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """The model's logits at every position of `ids` [len, vocab]."""
    with torch.no_grad():
        return hf[0](torch.tensor([ids])).logits[0]


def hf_greedy(hf, ids: list[int], num_tokens: int, process=lambda logits, out: logits) -> list[int]:
    """Greedy decoding by hand, each step's last logits through `process(logits, generated so far)`."""
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(int(process(hf_logits(hf, ids + out)[-1], out).argmax()))
    return out


@pytest.mark.parametrize("params", [ProcessorParams(top_k=5), ProcessorParams(top_p=0.05), ProcessorParams(min_p=0.15),
                                    ProcessorParams(temperature=0.8, top_k=20, top_p=0.6)],
                         ids=["top_k", "top_p", "min_p", "top_k+top_p"])
def test_draws_stay_in_what_transformers_warpers_keep(client, hf, params):
    """The tiny model's next-token distribution is flat: these keep a handful of tokens."""
    ids = client.tokenize(PROMPT)
    kept = set(torch.nonzero(~torch.isneginf(hf_row(hf_logits(hf, ids)[-1], params))).flatten().tolist())
    assert 1 < len(kept) < 50
    draws = [c.token_ids[0] for seed in range(3) for c in client.generate_n(
        ids, n=MAX_N, max_tokens=1, seed=seed, temperature=params.temperature, top_k=params.top_k or None,
        top_p=params.top_p, min_p=params.min_p or None)]
    assert set(draws) <= kept and len(set(draws)) > 1, (sorted(set(draws)), sorted(kept))


@pytest.mark.parametrize("penalty", [1.5, 0.3])
def test_repetition_penalty_gives_transformers_greedy_tokens(client, hf, penalty):
    ids = client.tokenize(PROMPT)
    with torch.no_grad():
        want = hf[0].generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              repetition_penalty=penalty)[0, len(ids):].tolist()
    got = client.generate(ids, max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=penalty)
    assert got.token_ids == want
    if penalty < 1:  # the tiny model never repeats itself unasked: a penalty below 1 makes it
        assert want != client.generate(ids, max_tokens=24, temperature=0, ignore_eos=True).token_ids


def test_presence_and_frequency_penalties_give_the_plain_loops_greedy_tokens(client, hf):
    """The tiny model never repeats a token on its own in 24 greedy steps, so a logit bias makes one
    token win again and again; the penalties, which grow with each repeat, push it back."""
    ids, favourite, bias = client.tokenize(PROMPT), 1000, 12.0

    def penalize(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        logits = logits.clone()
        logits[favourite] += bias
        for token in set(out):
            logits[token] -= 1.5 + 0.75 * out.count(token)
        return logits

    biased = client.generate(ids, max_tokens=24, temperature=0, ignore_eos=True, logit_bias={favourite: bias})
    got = client.generate(ids, max_tokens=24, temperature=0, ignore_eos=True, logit_bias={favourite: bias},
                          presence_penalty=1.5, frequency_penalty=0.75)
    assert got.token_ids == hf_greedy(hf, ids, 24, penalize)
    assert 1 < got.token_ids.count(favourite) < biased.token_ids.count(favourite)  # the count term shows


def test_logit_bias_and_min_tokens_hold_a_stop_token_back(client, hf):
    ids, favourite = client.tokenize(PROMPT), 1000
    got = client.generate(ids, max_tokens=10, temperature=0, logit_bias={favourite: 100.0},
                          stop_token_ids=[favourite], min_tokens=3)
    suppress = SuppressTokensLogitsProcessor([favourite])
    want = hf_greedy(hf, ids, 3, lambda logits, out: suppress(None, logits[None])[0])
    assert got.token_ids == want + [favourite]
    assert (got.finish_reason, got.stop_reason) == ("FINISH_REASON_STOP", favourite)


def test_a_stop_string_across_tokens_ends_the_text_and_is_reported(client):
    ids = client.tokenize(PROMPT)
    full = client.generate(ids, max_tokens=40, temperature=0, ignore_eos=True)
    pieces = [client.detokenize([t]) for t in full.token_ids]
    # A stop string over a token boundary: the last 2 characters of token 10, the first 2 of token 11.
    boundary = sum(len(p) for p in pieces[:11])
    stop = full.text[boundary - 2:boundary + 2]
    start = full.text.index(stop)
    for include in (False, True):
        messages = list(client.stream(ids, max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "\x00never"],
                                      include_stop_str_in_output=include))
        text = "".join(m.text for m in messages)
        assert text == full.text[:start] + (stop if include else "")
        tokens = [t for m in messages for t in m.token_ids]
        assert tokens == full.token_ids[:len(tokens)] and stop in client.detokenize(tokens)
        assert stop not in client.detokenize(tokens[:-1])  # the last token sent completed it
        last = messages[-1]
        assert (last.finish_reason, last.stop_string) == (llm_pb2.FINISH_REASON_STOP, stop)
        assert last.usage.completion_tokens == len(tokens)


def test_a_multibyte_stop_string_never_leaks_a_byte(client):
    request = dict(prompt="写一首关于大海的诗 🌊", max_tokens=48, temperature=1.0, seed=3, ignore_eos=True)
    full = client.generate(**request)
    wide = [i for i, ch in enumerate(full.text) if ord(ch) > 0x7FF and i > 4]
    assert wide, f"no multi-byte character was generated: {full.text!r}"
    stop = full.text[wide[0] - 1:wide[0] + 1]
    got = client.generate(**request, stop=[stop])
    assert got.text == full.text[:full.text.index(stop)] and got.stop_reason == stop


def test_logprobs_are_transformers_log_softmax_of_the_raw_logits(client, hf):
    ids = client.tokenize(PROMPT * 12)  # longer than a prefill chunk (64 tokens): scored across chunks
    assert len(ids) > 64
    got = client.generate(ids, max_tokens=8, temperature=0.7, seed=1, ignore_eos=True, logprobs=5, prompt_logprobs=3,
                          top_k=40, repetition_penalty=1.3)  # processors never change the reported logprobs
    reference = torch.log_softmax(hf_logits(hf, ids + got.token_ids), dim=-1)
    assert len(got.logprobs) == 8 and len(got.prompt_logprobs) == len(ids) - 1
    scored = [(len(ids) - 1 + i, token, entry) for i, (token, entry) in enumerate(zip(got.token_ids, got.logprobs))]
    scored += [(i, ids[i + 1], entry) for i, entry in enumerate(got.prompt_logprobs)]
    for position, token, entry in scored:
        row = reference[position]
        num_top = len(entry.top)
        assert entry.token.token_id == token and entry.token.text == hf[1].decode([token])
        assert entry.token.logprob == pytest.approx(row[token].item(), abs=1e-4)
        value = row[token]  # its rank, up to the tokens within float noise of it
        assert int((row > value + 1e-4).sum()) + 1 <= entry.token.rank <= int((row > value - 1e-4).sum()) + 1
        assert [top.token_id for top in entry.top] == row.topk(num_top).indices.tolist()
        assert [top.logprob for top in entry.top] == pytest.approx(row.topk(num_top).values.tolist(), abs=1e-4)
    assert {len(entry.top) for entry in got.logprobs} == {5} and {len(e.top) for e in got.prompt_logprobs} == {3}


def test_n_completions_compute_the_prompt_once(client):
    ids = [(i * 7919 + 13) % 150000 for i in range(3 * BLOCK_SIZE + 2)]  # three full blocks, then two tokens
    before = client.stats()
    completions = client.generate_n(ids, n=4, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    after = client.stats()
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert [c.usage.cached_prompt_tokens for c in completions] == [0] + [3 * BLOCK_SIZE] * 3
    assert after.prefill_tokens - before.prefill_tokens == len(ids) + 3 * 2  # the others computed their last 2
    assert len({tuple(c.token_ids) for c in completions}) == 4 and all(len(c.token_ids) == 6 for c in completions)
    alone = client.generate(ids, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    assert alone.token_ids == completions[0].token_ids
    again = client.generate_n(ids, n=4, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour. 你好"}]


def hf_chat_ids(hf, messages: list[dict], **template_kwargs) -> list[int]:
    return list(hf[1].apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                          **template_kwargs)["input_ids"])


def test_chat_is_generate_on_the_tokenizers_own_template(client, hf):
    want_ids = hf_chat_ids(hf, MESSAGES, enable_thinking=False)
    request = llm_pb2.TokenizeRequest(messages=[llm_pb2.ChatMessage(**m) for m in MESSAGES])
    request.chat_template_kwargs.update({"enable_thinking": False})
    assert list(client.stub.Tokenize(request).token_ids) == want_ids
    got = client.chat(MESSAGES, chat_template_kwargs={"enable_thinking": False}, max_tokens=12, temperature=0,
                      ignore_eos=True)
    want = client.generate(want_ids, max_tokens=12, temperature=0, ignore_eos=True)
    assert (got.token_ids, got.text, got.usage.prompt_tokens) == (want.token_ids, want.text, len(want_ids))
    thinking = client.chat(MESSAGES, max_tokens=1, temperature=0)
    assert thinking.usage.prompt_tokens != len(want_ids)  # the switch reached the template


def test_detokenize_matches_transformers(client, hf):
    ids = hf_chat_ids(hf, MESSAGES)
    assert client.detokenize(ids) == hf[1].decode(ids)
    assert client.detokenize(ids, skip_special_tokens=True) == hf[1].decode(ids, skip_special_tokens=True)


def wait_all_blocks_free(client, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        stats = client.stats()
        if stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == stats.num_waiting == 0:
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"blocks still held: {client.stats()}")


def test_a_passed_deadline_cancels_the_request_and_frees_its_blocks(client):
    received = 0
    with pytest.raises(grpc.RpcError) as raised:
        for msg in client.stream(list(range(100, 180)), max_tokens=3000, temperature=0, ignore_eos=True, n=2,
                                 timeout=1.5):
            received += len(msg.token_ids)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and received > 0
    assert wait_all_blocks_free(client, timeout=1.0) < 1.0


@pytest.mark.parametrize("sampling, fragment", [
    (dict(top_p=0.0), "top_p must be in (0, 1]"), (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-2), "top_k must be -1 or 0 (off) or at least 1"), (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in > 0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2]"),
    (dict(logit_bias={5: 101.0}), "logit_bias of token 5 must be in [-100, 100]"),
    (dict(logit_bias={10**7: 1.0}), "logit_bias: token id 10000000 is outside the vocabulary"),
    (dict(logprobs=21), "logprobs must be in [0, 20] (this server's --max-logprobs)"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be in [0, 20]"),
    (dict(n=MAX_N + 1), f"n must be in [1, {MAX_N}] (this server's --max-n)"), (dict(n=0), "n must be in [1,"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be in [0, max_tokens = 4]"),
    (dict(stop=["ok", ""]), "stop strings must not be empty"),
])
def test_bad_values_are_refused_naming_the_field_and_its_range(client, sampling, fragment):
    with pytest.raises(grpc.RpcError) as raised:
        client.generate_n([1, 2, 3], **sampling)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in raised.value.details()


def test_bad_chat_requests_are_refused(client):
    with pytest.raises(grpc.RpcError) as raised:
        client.chat([])
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in raised.value.details()
    info = client.model_info()
    assert (info.max_n, info.max_logprobs) == (MAX_N, 20)


def test_the_node_client_sends_the_sampling_controls(service, client):
    node = shutil.which("node")
    if node is None or not (REPO / "tests/services/node/node_modules").exists():
        pytest.skip("node or tests/services/node/node_modules missing (make install provides them)")
    controls = dict(temperature=1.0, seed=3, top_k=5, top_p=0.9)
    argv = [word for name, value in controls.items() for word in (f"--{name.replace('_', '-')}", str(value))]
    out = subprocess.run([node, str(REPO / "tests/services/node/generate.mjs"), service["address"], *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    same = client.generate(result["prompt_token_ids"], max_tokens=len(result["token_ids"]), ignore_eos=True,
                           **controls)
    assert result["token_ids"] == same.token_ids
    assert result["token_ids"] != client.generate(result["prompt_token_ids"], max_tokens=len(result["token_ids"]),
                                                  ignore_eos=True, temperature=1.0, seed=3).token_ids


def test_the_cli_takes_the_new_controls(service, client):
    """`nanoserve generate` with sampling controls, a stop string and logprobs; `nanoserve chat`."""
    full = client.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    stop = full.text[5:8]
    args = ["--address", service["address"], "--max-tokens", "16", "--ignore-eos", "--temperature", "0", "--top-k",
            "5", "--repetition-penalty", "1.0"]
    stops = ["--stop", "~never~", "--stop", stop]
    out = subprocess.run(CLI + ["generate", PROMPT, *args, *stops], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == full.text[:full.text.index(stop)]
    assert f"[FINISH_REASON_STOP at {stop!r}:" in out.stderr
    out = subprocess.run(CLI + ["generate", PROMPT, *args, "--logprobs", "2"], env=ENV, capture_output=True,
                         text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 16, out.stderr
    assert all(line.startswith(repr(client.detokenize([t])) + " -") and "(rank 1)" in line
               for line, t in zip(lines, full.token_ids))  # greedy: each token the most likely
    out = subprocess.run(CLI + ["chat", "Name a colour.", "--address", service["address"], "--max-tokens", "4",
                                "--temperature", "0", "--system", "Be brief.",
                                "--chat-template-kwargs", '{"enable_thinking": false}'],
                         env=ENV, capture_output=True, text=True, timeout=60)
    want = client.chat(MESSAGES[:1] + [{"role": "user", "content": "Name a colour."}], max_tokens=4, temperature=0,
                       chat_template_kwargs={"enable_thinking": False})
    assert out.returncode == 0 and out.stdout == want.text
    bad = subprocess.run(CLI + ["chat", "hi", "--address", service["address"], "--chat-template-kwargs", "[1]"],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be a JSON object" in bad.stderr
