"""nanoserve_kernels/token_bitmask.py's apply_token_bitmask in one Triton launch: a program per (masked
row, vocabulary range) reads its range's mask words once and writes -inf only where a token is
refused, so a mostly-open row (free text inside a JSON string) costs a read of its logits and little else."""
import torch
import triton
import triton.language as tl

# Vocabulary entries per program: [256, 151,936] is 256 x 75 programs.
BLOCK = 2048


# The mask rows are often a view into the step's index buffers, at any 8-byte offset: one compile for all.
@triton.jit(do_not_specialize=["vocab_size", "words"], do_not_specialize_on_alignment=["mask_rows", "rows"])
def _bitmask_kernel(logits, stride_row, bitmask, mask_rows, rows, vocab_size, words, EVERY_ROW: tl.constexpr,
                    BLOCK: tl.constexpr):
    index = tl.program_id(0)
    entries = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = index.to(tl.int64) if EVERY_ROW else tl.load(rows + index)
    mask_row = tl.load(mask_rows + index).to(tl.int64)
    inside = entries < vocab_size
    word = tl.load(bitmask + mask_row * words + entries // 32, mask=inside, other=0)
    refused = ((word >> (entries % 32)) & 1) == 0
    tl.store(logits + row * stride_row + entries, tl.full([BLOCK], float("-inf"), tl.float32).to(logits.dtype.element_ty),
             mask=inside & refused)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor,
                        rows: torch.Tensor | None) -> None:
    """nanoserve_kernels.token_bitmask.apply_token_bitmask, in one launch."""
    vocab_size = logits.shape[1]
    assert logits.stride(1) == 1 and bitmask.is_contiguous()
    if len(mask_rows):
        _bitmask_kernel[(len(mask_rows), triton.cdiv(vocab_size, BLOCK))](
            logits, logits.stride(0), bitmask, mask_rows, mask_rows if rows is None else rows, vocab_size,
            bitmask.shape[1], EVERY_ROW=rows is None, BLOCK=BLOCK)
