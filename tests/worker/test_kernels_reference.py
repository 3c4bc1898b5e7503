"""The plain-torch paged KV cache and attention (the CPU path and the GPU kernels' oracle) against
dense causal attention computed straight from each sequence's full K/V, and backend selection."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from nanoserve_kernels import reference
from nanoserve_kernels.backend import auto_backend_name, select_backend
from nanoserve_kernels.kv_quant import FP8_DTYPE, FP8_MAX, dequantize, quantize, scales_shape
from nanoserve.mathutil import cdiv

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 64
SCALE = HEAD_DIM ** -0.5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] for the last n of L positions over k/v [L, KvH, D], causal, via SDPA."""
    n, length = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                         v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1)


class PagedSequences:
    """Random sequences laid out in a shuffled block pool, with their full K/V kept densely."""

    def __init__(self, lengths: list[int], seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.v_cache = torch.zeros_like(self.k_cache)
        pool = torch.randperm(NUM_BLOCKS, generator=self.g).tolist()
        self.tables, self.k, self.v = [], [], []
        for length in lengths:
            count = cdiv(length, BLOCK_SIZE)
            self.tables.append(pool[:count])
            pool = pool[count:]
            self.k.append(torch.randn(length, KV_HEADS, HEAD_DIM, generator=self.g))
            self.v.append(torch.randn(length, KV_HEADS, HEAD_DIM, generator=self.g))

    def slots(self, i: int, start: int, end: int) -> list[int]:
        return [self.tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]

    def store(self, i: int, start: int, end: int) -> None:
        reference.store_kvcache(self.k[i][start:end], self.v[i][start:end], self.k_cache, self.v_cache,
                                torch.tensor(self.slots(i, start, end)))

    def block_tables(self) -> torch.Tensor:
        width = max(map(len, self.tables))
        return torch.tensor([t + [-1] * (width - len(t)) for t in self.tables], dtype=torch.int32)


def test_store_writes_each_row_at_its_slot_and_skips_minus_one():
    seqs = PagedSequences([6], seed=0)
    slots = torch.tensor(seqs.slots(0, 0, 6))
    slots[2] = -1
    reference.store_kvcache(seqs.k[0], seqs.v[0], seqs.k_cache, seqs.v_cache, slots)
    flat_k, flat_v = seqs.k_cache.flatten(0, 1), seqs.v_cache.flatten(0, 1)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], seqs.k[0][row]) and torch.equal(flat_v[slot], seqs.v[0][row])
    skipped = seqs.slots(0, 2, 3)[0]
    assert not flat_k[skipped].any() and not flat_v[skipped].any()
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 5  # nothing written elsewhere


@pytest.mark.parametrize("cached, new", [([0, 0, 0], [5, 1, 13]), ([8, 3, 0], [4, 9, 1]), ([12, 7], [1, 1])])
def test_prefill_over_a_cached_prefix_matches_dense_attention(cached, new):
    """Sequence i has cached[i] tokens already in the cache and computes new[i] more (prefix hits,
    chunked prefill and single decode-like rows in one varlen batch)."""
    lengths = [c + n for c, n in zip(cached, new)]
    seqs = PagedSequences(lengths, seed=sum(lengths))
    for i, (c, length) in enumerate(zip(cached, lengths)):
        seqs.store(i, 0, c)
        seqs.store(i, c, length)
    q = torch.randn(sum(new), HEADS, HEAD_DIM, generator=seqs.g)
    cu_seqlens = torch.tensor([0] + new, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_seqlens_k = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = reference.paged_prefill(q, seqs.k_cache, seqs.v_cache, cu_seqlens, cu_seqlens_k, max(new), max(lengths),
                                  seqs.block_tables(), SCALE)
    for i, length in enumerate(lengths):
        lo, hi = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        expected = dense_attention(q[lo:hi], seqs.k[i], seqs.v[i])
        torch.testing.assert_close(out[lo:hi], expected, rtol=1e-5, atol=1e-5)


def test_decode_matches_dense_attention_and_padding_rows_give_zeros():
    lengths = [1, 4, 5, 17, 30]
    seqs = PagedSequences(lengths, seed=7)
    for i, length in enumerate(lengths):
        seqs.store(i, 0, length)
    q = torch.randn(len(lengths) + 1, HEADS, HEAD_DIM, generator=seqs.g)
    tables = torch.cat([seqs.block_tables(), torch.full((1, seqs.block_tables().shape[1]), -1, dtype=torch.int32)])
    out = reference.paged_decode(q, seqs.k_cache, seqs.v_cache, torch.tensor(lengths + [0], dtype=torch.int32),
                                 tables, SCALE)
    for i in range(len(lengths)):
        torch.testing.assert_close(out[i:i + 1], dense_attention(q[i:i + 1], seqs.k[i], seqs.v[i]),
                                   rtol=1e-5, atol=1e-5)
    assert not out[-1].any()


def test_backends_are_chosen_by_name_and_device():
    torch_backend = select_backend("auto", "cpu", 16)
    assert torch_backend.name == "torch"
    assert torch_backend.paged_decode is reference.paged_decode
    assert auto_backend_name("cuda", 16) == "triton"  # flash-attn needs blocks of 256
    with pytest.raises(ValueError, match="multiple of 256"):
        select_backend("flash-attn", "cuda", 16)
    with pytest.raises(ValueError, match="attention backend 'cudnn'"):
        select_backend("cudnn", "cpu", 16)


def test_fp8_rows_round_trip_within_half_an_e4m3_step():
    """Each row (one token, one KV head) spans e4m3's full range with its own scale; reading back
    is off by at most half a step: 2**-4 of the value (3 mantissa bits), or 2**-10 of the scale
    among e4m3's subnormals. An all-zero row stays zero."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 3, 32, generator=gen) * torch.logspace(-5, 4, 64)[:, None, None]
    rows[0, 1] = 0
    values, scales = quantize(rows)
    assert values.dtype == FP8_DTYPE and scales.shape == (64, 3)
    back = dequantize(values, scales)
    bound = torch.maximum(rows.abs() * 2**-4, scales[..., None] * 2**-10)
    assert ((back - rows).abs() <= bound * (1 + 1e-6)).all()
    assert not back[0, 1].any() and torch.isfinite(scales).all()
    assert (values.float().abs().amax(-1) == FP8_MAX).sum() == 64 * 3 - 1


def test_fp8_cache_attention_is_dense_attention_over_the_round_tripped_rows():
    lengths = [3, 9, 17]
    seqs = PagedSequences(lengths, seed=11)
    seqs.k_cache, seqs.v_cache = seqs.k_cache.to(FP8_DTYPE), seqs.v_cache.to(FP8_DTYPE)
    scales = {name: torch.zeros(scales_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS)) for name in ("k_scale", "v_scale")}
    for i, length in enumerate(lengths):
        reference.store_kvcache(seqs.k[i], seqs.v[i], seqs.k_cache, seqs.v_cache,
                                torch.tensor(seqs.slots(i, 0, length)), **scales)
    q = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=seqs.g)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    prefill = reference.paged_prefill(q, seqs.k_cache, seqs.v_cache, cu_seqlens, cu_seqlens, max(lengths),
                                      max(lengths), seqs.block_tables(), SCALE, **scales)
    last = cu_seqlens[1:] - 1
    decode = reference.paged_decode(q[last], seqs.k_cache, seqs.v_cache, torch.tensor(lengths, dtype=torch.int32),
                                    seqs.block_tables(), SCALE, **scales)
    for i, length in enumerate(lengths):
        lo, hi = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        k, v = dequantize(*quantize(seqs.k[i])), dequantize(*quantize(seqs.v[i]))
        torch.testing.assert_close(prefill[lo:hi], dense_attention(q[lo:hi], k, v), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode[i:i + 1], prefill[hi - 1:hi], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(prefill[lo:hi], dense_attention(q[lo:hi], seqs.k[i], seqs.v[i]), atol=1e-4)


def test_an_fp8_cache_takes_triton_over_flash_attn(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else find_spec(name))
    assert auto_backend_name("cuda", 256) == "flash-attn"
    assert auto_backend_name("cuda", 256, fp8_kv=True) == "triton"
    assert select_backend("auto", "cpu", 256, fp8_kv=True).name == "torch"
    with pytest.raises(ValueError, match="flash-attn backend cannot read an FP8 KV cache"):
        select_backend("flash-attn", "cuda", 256, fp8_kv=True)
