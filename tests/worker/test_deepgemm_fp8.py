"""Where DeepGEMM's GEMM is taken (nanoserve_kernels/deepgemm_fp8.py), the layout its activations are
quantized in, and what a table entry naming it serves where it is not installed (here: no CUDA) or cannot
compile."""
import logging
import sys
import types

import torch

from nanoserve_kernels import deepgemm_fp8, fp8_configs, fp8_linear
from nanoserve_kernels.fp8_configs import DEEPGEMM, SCALED_MM, W8A8, Fp8Choice
from tests.worker.test_fp8_kernels import random_fp8

BLOCK = (128, 128)


def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_fp8(n, k, BLOCK, "cpu", n)


def test_it_takes_decode_batches_of_whole_128_blocks_in_bf16():
    weight, scale = fp8_weight(512, 256)
    assert all(deepgemm_fp8.takes(rows, weight, scale, BLOCK, torch.bfloat16) for rows in (2, 3, 100, 256))
    assert not deepgemm_fp8.takes(1, weight, scale, BLOCK, torch.bfloat16)  # one row: the gemv's
    assert not deepgemm_fp8.takes(257, weight, scale, BLOCK, torch.bfloat16)  # a prefill's rows: scaled_mm's
    assert not deepgemm_fp8.takes(64, weight, scale, BLOCK, torch.float16)  # its output is bf16 only
    assert not deepgemm_fp8.takes(64, weight, scale, (128, 64), torch.bfloat16)
    assert not deepgemm_fp8.takes(64, *fp8_weight(512 + 64, 256), BLOCK, torch.bfloat16)  # N not whole blocks
    assert not deepgemm_fp8.takes(64, weight, scale.t().contiguous().t(), BLOCK, torch.bfloat16)


def test_rows_are_padded_to_a_few_sizes_each_compiled_once():
    """To the bucket up to 64 rows, then to whole 64-row tiles: 8 sizes for the decode batches."""
    padded = {rows: deepgemm_fp8.padded_rows(rows) for rows in range(2, 257)}
    assert sorted(set(padded.values())) == [4, 8, 16, 32, 64, 128, 192, 256]
    assert all(rows <= size < max(2 * rows, rows + 64) or size == 4 for rows, size in padded.items())
    assert [padded[rows] for rows in (2, 5, 33, 65, 129, 144, 193)] == [4, 8, 64, 128, 192, 192, 256]


def test_an_entry_naming_deepgemm_runs_scaled_mm_where_it_is_not_installed(monkeypatch):
    weight, _ = fp8_weight(512, 256)
    named = Fp8Choice(W8A8, DEEPGEMM, {"BLOCK_M": 64})
    monkeypatch.setattr(fp8_linear, "_device_name", lambda device: "Tuned GPU")
    monkeypatch.setattr(fp8_configs, "choose", lambda *args: named)
    assert not deepgemm_fp8.available()  # no CUDA build of it on this machine
    assert fp8_linear.choice(64, weight) == Fp8Choice(W8A8, SCALED_MM, {"BLOCK_M": 64})
    assert fp8_linear.input_layout(named, torch.Size((7, 256)), weight, BLOCK) == dict(token_minor=True,
                                                                                      padded_rows=8)


def test_an_installed_deepgemm_takes_its_rows_padded(monkeypatch):
    weight, _ = fp8_weight(512, 256)
    monkeypatch.setattr(deepgemm_fp8, "available", lambda: True)
    named = Fp8Choice(W8A8, DEEPGEMM)
    assert fp8_linear.input_layout(named, torch.Size((7, 256)), weight, BLOCK) == dict(token_minor=True,
                                                                                      padded_rows=8)
    assert fp8_linear.input_layout(named, torch.Size((33, 256)), weight, BLOCK) == dict(token_minor=True,
                                                                                       padded_rows=64)
    assert fp8_linear.input_layout(named, torch.Size((144, 256)), weight, BLOCK) == dict(token_minor=True,
                                                                                        padded_rows=192)
    assert fp8_linear.input_layout(named, torch.Size((300, 256)), weight, BLOCK) == dict(token_minor=True,
                                                                                        padded_rows=300)


def test_an_installed_deepgemm_with_no_compiler_is_not_used_and_says_why(monkeypatch, caplog):
    def fake_deep_gemm(compiler) -> types.ModuleType:
        module = types.ModuleType("deep_gemm")
        module.jit = types.SimpleNamespace(get_nvcc_compiler=compiler)
        return module

    def no_nvcc():
        raise RuntimeError("Cannot find any available NVCC compiler")
    monkeypatch.delenv("DG_JIT_USE_NVRTC", raising=False)
    for compiler, expected in ((no_nvcc, False), (lambda: ("/usr/local/cuda/bin/nvcc", "13.0"), True)):
        monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm(compiler))
        deepgemm_fp8.available.cache_clear()
        with caplog.at_level(logging.WARNING, logger="nanoserve.kernels"):
            assert deepgemm_fp8.available() is expected
    deepgemm_fp8.available.cache_clear()
    assert [r.getMessage() for r in caplog.records] == [
        "DeepGEMM is installed but cannot compile its kernels (Cannot find any available NVCC compiler): its table "
        "entries run torch's scaled_mm"]
