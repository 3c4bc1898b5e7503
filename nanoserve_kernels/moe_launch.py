"""Launch configs of the fused MoE GEMMs: tile shapes per batch size, tuned per (experts, expert width
per rank, GPU, and whether the experts are e4m3) by bench/tune_moe.py into moe_configs/ beside this
file, else sane defaults.

A config for one batch size: BLOCK_M, the rows of the sort-and-pad both GEMMs share, and for each GEMM
("gate_up", "down") BLOCK_N, BLOCK_K, GROUP_M, num_warps and num_stages. A file holds the batch sizes
it was tuned at; a step takes the config of the smallest tuned batch at least as large (else the
largest), the way a step's token count falls between graph buckets."""
import functools
import json
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "moe_configs"
GEMMS = ("gate_up", "down")


def default_config(tokens: int, num_experts: int) -> dict:
    """Untuned: short row blocks while most experts see a token or two (decode), square tiles above."""
    if tokens * 2 <= num_experts:
        gemm = dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
        return dict(BLOCK_M=16, gate_up=gemm, down=gemm)
    gemm = dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, gate_up=gemm, down=gemm)


def config_name(num_experts: int, width: int, device_name: str, fp8: bool = False) -> str:
    """The file of (experts, per-rank expert width, GPU[, e4m3 experts]), e.g. E128_N768_NVIDIA_H100_80GB_HBM3.json
    or E128_N768_NVIDIA_H100_80GB_HBM3_fp8.json."""
    device = re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_')
    return f"E{num_experts}_N{width}_{device}{'_fp8' if fp8 else ''}.json"


@functools.cache
def tuned_configs(num_experts: int, width: int, device_name: str, fp8: bool = False) -> dict[int, dict]:
    """batch size -> config, from the tuned file ({} without one)."""
    path = CONFIG_DIR / config_name(num_experts, width, device_name, fp8)
    if not path.exists():
        return {}
    return {int(batch): config for batch, config in json.loads(path.read_text())["configs"].items()}


def launch_config(tokens: int, num_experts: int, width: int, device_name: str, fp8: bool = False) -> dict:
    """The config of this batch size; `fp8`: of e4m3 experts (their own file; the defaults otherwise)."""
    tuned = tuned_configs(num_experts, width, device_name, fp8)
    if not tuned:
        return default_config(tokens, num_experts)
    fitting = [batch for batch in tuned if batch >= tokens]
    return tuned[min(fitting) if fitting else max(tuned)]
