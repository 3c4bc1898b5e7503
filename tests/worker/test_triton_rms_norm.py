"""The RMSNorm kernel (nanoserve_kernels/triton_rms_norm.py) in Triton's interpreter on CPU, against
float64 from the same inputs and against the plain function of nanoserve_model/norm.py (run as the
interpreter's float32 here; on CUDA, tests/gpu/test_kernels_gpu.py compares it in bf16 with what
torch.compile makes of the plain function, the kernel it replaced). The interpreter must be set
before the kernel's module is imported, so the cases run in a process of their own
(tests/worker/interpreter.py)."""
import pytest
import torch

from nanoserve_model.norm import rms_normalize
from tests.worker.test_triton_kernels import TOLERANCE, assert_nearly_same, relative_error

# (rows, columns): a masked tail, a Qwen3 hidden size, one row, no rows; and a 3-d input (tokens, heads, dim)
SHAPES = ((5, 1000), (3, 1024), (1, 7), (0, 64), (2, 3, 128))


def _float64_norm(s: torch.Tensor, normed_from: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s, normed_from = s.double(), normed_from.double()
    return weight.double() * normed_from * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)


def check_rms_norm(device: str, dtype: torch.dtype, plain_differ: float, compiled: bool = False) -> None:
    """norm(x) and (norm(x + residual), x + residual) for every shape: within the dtype's tolerance
    of float64, the residual bit for bit the rounded sum, and equal to the plain (or with `compiled`,
    the torch.compile'd) function but in at most a `plain_differ` share of elements."""
    from nanoserve_kernels.triton_rms_norm import rms_norm

    def plain(x, residual, weight, eps):
        residual = x + residual
        return rms_normalize(residual, weight, eps), residual
    separate_norm = torch.compile(rms_normalize, dynamic=True) if compiled else rms_normalize
    separate_add = torch.compile(plain, dynamic=True) if compiled else plain
    generator = torch.Generator(device).manual_seed(0)
    eps = 1e-6
    for shape in SHAPES:
        x, residual = [(3 * torch.randn(shape, generator=generator, device=device)).to(dtype) for _ in range(2)]
        weight = (1 + torch.randn(shape[-1], generator=generator, device=device) / 4).to(dtype)
        got = rms_norm(x, weight, eps)
        got_norm, got_residual = rms_norm(x, weight, eps, residual)
        assert got.shape == x.shape and got.dtype == dtype and got_norm.shape == x.shape, shape
        summed = x.double() + residual.double()
        assert torch.equal(got_residual, summed.to(dtype)), shape
        if not x.numel():
            continue
        assert relative_error(got, _float64_norm(x, x, weight, eps)) < TOLERANCE[dtype], shape
        assert relative_error(got_norm, _float64_norm(summed, got_residual, weight, eps)) < TOLERANCE[dtype], shape
        assert_nearly_same(got, separate_norm(x, weight, eps), plain_differ, ("norm", shape))
        expected_norm, expected_residual = separate_add(x, residual, weight, eps)
        assert torch.equal(got_residual, expected_residual), shape
        assert_nearly_same(got_norm, expected_norm, plain_differ, ("add and norm", shape))


def run_interpreted_cases(case: str) -> None:
    """In the interpreter's process: float32 on both sides. The plain function's summation order is torch's, the
    kernel's numpy's, and with a residual the plain function takes its statistics from the rounded sum: a step
    apart."""
    check_rms_norm("cpu", torch.float32, plain_differ=0.5)


@pytest.mark.xdist_group("interpreter-rms_norm")
def test_rms_norm_kernel_matches_the_references_in_the_interpreter(interpreter) -> None:
    interpreter.run(__file__, "float32", timeout=300)
