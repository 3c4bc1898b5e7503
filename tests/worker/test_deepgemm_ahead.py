"""DeepGEMM's kernels compiled ahead at start (nanoserve_model/deepgemm_ahead.py): which (rows, N, K) the FP8
launch table sends to DeepGEMM, one kernel each, and a failure that only says so. On the tiny FP8 checkpoint,
with a table (stood in) that gives DeepGEMM the gate/up projections from 64 rows."""
import logging

import torch

from nanoserve_kernels import deepgemm_fp8, fp8_linear
from nanoserve_kernels.fp8_configs import DEEPGEMM, TRITON, W8A8, Fp8Choice, bucket
from nanoserve_model.deepgemm_ahead import compile_deepgemm_ahead, deepgemm_gemms
from tests.worker.fp8_models import tiny_fp8_dir
from tests.worker.test_fp8_weights import load


TILING = {"block_m": 128, "block_n": 64, "multicast": "b"}


def gate_up_on_deepgemm_from_64_rows(monkeypatch) -> None:
    """The gate/up projections on DeepGEMM from 64 rows: in its own tiling at 64, in TILING from 128."""
    def choice(rows: int, weight: torch.Tensor, silu_mul: bool = False) -> Fp8Choice:
        if not silu_mul or bucket(rows) < 64:
            return Fp8Choice(W8A8, TRITON)
        return Fp8Choice(W8A8, DEEPGEMM, {DEEPGEMM: TILING} if bucket(rows) >= 128 else {})
    monkeypatch.setattr(fp8_linear, "choice", choice)
    monkeypatch.setattr(fp8_linear, "takes_deepgemm", lambda *args: True)  # the tiny model's blocks are 16 x 16
    monkeypatch.setattr(deepgemm_fp8, "available", lambda: True)


def test_one_kernel_for_each_padded_row_count_and_shape_deepgemm_serves(monkeypatch):
    gate_up_on_deepgemm_from_64_rows(monkeypatch)
    model = load(tiny_fp8_dir("fp8"), fp8_weights=True)
    gemms = deepgemm_gemms(model, torch.float32)
    # rows 33-256, padded: four kernels, each in the tiling its bucket gives
    assert sorted((rows, tiling == TILING) for rows, _, _, tiling in gemms) == [
        (64, False), (128, True), (192, True), (256, True)]
    gate_ups = [layer.mlp.gate_up_proj for layer in model.model.layers]
    for _, weight, scale, _ in gemms:  # of a gate/up layer (every layer's is the same shape: one is enough)
        assert any(weight is proj.weight and scale is proj.weight_scale for proj in gate_ups)


def test_the_kernels_are_compiled_together_and_a_failure_only_says_so(monkeypatch, caplog):
    gate_up_on_deepgemm_from_64_rows(monkeypatch)
    model = load(tiny_fp8_dir("fp8"), fp8_weights=True)
    compiled = []
    monkeypatch.setattr(deepgemm_fp8, "compile_ahead", lambda gemms, threads: compiled.append((len(gemms), threads)))
    with caplog.at_level(logging.INFO, logger="nanoserve.worker"):
        compile_deepgemm_ahead(model, torch.float32, rank=0)
    assert len(compiled) == 1 and compiled[0][0] == 4 and compiled[0][1] >= 1
    assert "rank 0: DeepGEMM: 4 kernels ready in" in caplog.text

    def no_nvcc(gemms, threads):
        raise RuntimeError("nvcc died")
    monkeypatch.setattr(deepgemm_fp8, "compile_ahead", no_nvcc)
    caplog.clear()
    compile_deepgemm_ahead(model, torch.float32, rank=1)  # no exception: the warm-up compiles instead
    assert caplog.records[-1].levelno == logging.WARNING
    assert "rank 1: DeepGEMM's kernels not compiled ahead (RuntimeError: nvcc died)" in caplog.text


def test_nothing_is_compiled_where_deepgemm_is_not_installed(monkeypatch):
    gate_up_on_deepgemm_from_64_rows(monkeypatch)
    monkeypatch.setattr(deepgemm_fp8, "available", lambda: False)
    compiled = []
    monkeypatch.setattr(deepgemm_fp8, "compile_ahead", lambda gemms, threads: compiled.append(gemms))
    compile_deepgemm_ahead(load(tiny_fp8_dir("fp8"), fp8_weights=True), torch.float32, rank=0)
    assert not compiled
