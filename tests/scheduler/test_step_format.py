"""The step message's columns (worker.proto, step_format 2): the scheduler's fast encoder writes what
the row-wise packer in the contract package writes for the same entries, and token ids of any size
survive the packing."""
import pytest

from nanoserve.step_rows import pack_step, unpack_step
from nanoserve.wire import pack_token_ids, unpack_token_ids
from scheduler_svc.step_encoder import encode_step
from tests.scheduler.test_scheduler_edges import add, make_scheduler


def test_token_ids_pack_to_four_little_endian_bytes_each():
    ids = [0, 1, 255, 256, 151_935, 2**32 - 1]
    packed = pack_token_ids(ids)
    assert len(packed) == 4 * len(ids) and packed[8:12] == bytes([255, 0, 0, 0])
    assert unpack_token_ids(packed) == ids
    with pytest.raises(OverflowError):
        pack_token_ids([2**32])


def test_the_encoder_writes_what_the_row_packer_writes():
    """A run with chunked prompts, decodes of tokens still in flight, new blocks, resets with
    penalties (their history) and prompt scoring: every step, re-packed from its own rows, is the
    same message."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, 1, list(range(100, 130)), max_tokens=6, repetition_penalty=1.1, prompt_logprobs=1)
    add(scheduler, 2, list(range(200, 205)), max_tokens=9, seed=3)
    in_flight, steps, seen = [], 0, set()
    while scheduler.has_work():
        plan = scheduler.schedule()
        if plan is not None:
            request = encode_step(plan)
            assert pack_step(plan.step_id, unpack_step(request), request.forget_seq_ids) == request
            steps += 1
            seen |= {"fed"} if 0 in request.num_token_ids else set()
            seen |= {name for item in request.extras for name in ("history_token_ids", "prompt_logprob_targets")
                     if getattr(item, name)}
            in_flight.append(plan)
        if len(in_flight) == 3 or plan is None:  # three steps in flight, as the engine keeps
            done = in_flight.pop(0)
            scheduler.postprocess(done, [151_935] * len(done.sampled))
    assert steps > 10 and seen == {"fed", "history_token_ids", "prompt_logprob_targets"}
