"""The length limit a scheduler serves: one sequence of max_model_len must fit the KV pool (an
explicit --max-model-len that cannot is refused at start, naming the flags; the model's own limit
is capped to the pool with a warning), and a request asking for more tokens than the limit leaves
is INVALID_ARGUMENT, not cut short."""
import logging

import grpc
import pytest

from scheduler_svc.request_validation import BadRequest, check_room
from scheduler_svc.server import StartupError, _fitting_max_model_len


def test_a_limit_that_fits_is_kept():
    assert _fitting_max_model_len(1024, asked=True, num_blocks=64, block_size=16) == 1024
    assert _fitting_max_model_len(1000, asked=False, num_blocks=64, block_size=16) == 1000


def test_an_explicit_limit_beyond_the_pool_is_refused_naming_the_flags():
    with pytest.raises(StartupError) as info:
        _fitting_max_model_len(40960, asked=True, num_blocks=36, block_size=256)
    message = str(info.value)
    assert "--max-model-len 40960 does not fit the KV pool" in message
    assert "needs 160 blocks of 256 tokens and the workers hold 36 (9216 tokens)" in message
    assert all(flag in message for flag in ("--gpu-memory-utilization", "--cpu-kv-cache-gb", "--num-kv-blocks"))


def test_the_models_own_limit_is_capped_to_the_pool_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="nanoserve.scheduler"):
        assert _fitting_max_model_len(40960, asked=False, num_blocks=36, block_size=256) == 9216
    assert "max model len capped to 9216 tokens" in caplog.text and "--max-model-len" in caplog.text


def test_max_tokens_beyond_the_limit_is_invalid():
    check_room(100, 24, 124)
    check_room(100, None, 124)  # unset: generate up to the limit
    with pytest.raises(BadRequest) as info:
        check_room(100, 25, 124)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 24 tokens" in str(info.value)
