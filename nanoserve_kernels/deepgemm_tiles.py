"""DeepGEMM's tiles, chosen by bench/tune_fp8.py instead of by DeepGEMM's heuristic where that measured faster.

DeepGEMM picks a GEMM's output tile by waves of tiles over the multiprocessors alone. At decode batches
(64-256 rows) that often means 64-row tiles each reading a narrow weight slice plus all of the activations
once per column tile, and no TMA multicast below 512 rows: the 4,096-wide projections then read their weights
at ~1.8 TB/s. A tiling here is {"block_m", "block_n", "multicast"}: the output tile, and the operand two
neighbouring programs load once for both ("a": the activations, shared along N; "b": the weight tile, along
M; "": none). It is stored in the launch table's DeepGEMM entries under "deepgemm" and applied by replacing
DeepGEMM's config function for the duration of a call, on the calling thread only (the compile-ahead threads
each force their own). The kernel itself is DeepGEMM's, unchanged; a tiling only picks its template
arguments."""
import contextlib
import functools
import itertools
import math
import threading
from collections.abc import Iterator

BLOCK_MS = (64, 128, 256)
BLOCK_NS = (16, 24, 32, 48, 64, 96, 128, 144, 160)  # DeepGEMM's widths, less some of its odd steps
MULTICASTS = ("", "a", "b")
SMEM_BYTES = 232448  # an sm90 multiprocessor's shared memory for one program, DeepGEMM's figure
LAST_WAVE_FULL = 0.45
EXTRA_WAVES = 1  # a wave more than the fewest: taller tiles sharing their weight tile can repay it (measured)

Tiling = dict  # {"block_m": int, "block_n": int, "multicast": str}
_forced = threading.local()


def candidates(rows: int, n: int, num_sms: int) -> list[Tiling]:
    """The tilings the tuner times for a GEMM of `rows` (padded) rows and N columns: every tile shape that
    takes at most EXTRA_WAVES more waves of tiles than the fewest any shape takes, its last wave at least
    LAST_WAVE_FULL full, with and without each multicast that has a neighbour."""
    shapes = {}
    for block_m, block_n in itertools.product(BLOCK_MS, BLOCK_NS):
        if block_m < 2 * max(64, rows) and (block_m <= 128 or block_n <= 128):  # no tile half past the rows
            shapes[block_m, block_n] = -(-rows // block_m), -(-n // block_n)
    fewest = min(-(-m_blocks * n_blocks // num_sms) for m_blocks, n_blocks in shapes.values())
    found = []
    for (block_m, block_n), (m_blocks, n_blocks) in shapes.items():
        waves = -(-m_blocks * n_blocks // num_sms)
        if waves <= fewest + EXTRA_WAVES and m_blocks * n_blocks >= (waves - 1 + LAST_WAVE_FULL) * num_sms:
            found += [{"block_m": block_m, "block_n": block_n, "multicast": multicast} for multicast in MULTICASTS
                      if multicast == "" or (n_blocks if multicast == "a" else m_blocks) >= 2]
    return found


@contextlib.contextmanager
def forced(tiling: Tiling | None) -> Iterator[None]:
    """DeepGEMM's GEMMs called inside take `tiling` (on this thread); None leaves DeepGEMM's own choice."""
    if tiling is None:
        yield
        return
    _install()
    _forced.tiling = tiling
    try:
        yield
    finally:
        _forced.tiling = None


@functools.cache
def _install() -> None:
    """Wraps DeepGEMM's config function (its GEMM looks it up by name at each call) once per process."""
    from deep_gemm.jit_kernels import gemm as dg_gemm
    heuristic = dg_gemm.get_best_configs

    def configs(m: int, n: int, k: int, num_groups: int, num_sms: int, *args, **kwargs):
        tiling = getattr(_forced, "tiling", None)
        if tiling is None or num_groups != 1 or args or kwargs:  # grouped and wgrad GEMMs keep DeepGEMM's choice
            return heuristic(m, n, k, num_groups, num_sms, *args, **kwargs)
        return _configs(dg_gemm.get_smem_config, m, n, k, num_sms, tiling)
    dg_gemm.get_best_configs = configs


def _configs(smem_config, m: int, n: int, k: int, num_sms: int, tiling: Tiling) -> tuple:
    """DeepGEMM's config tuple for a tiling: multiprocessors used, tile, pipeline stages (the most that fit,
    as DeepGEMM counts them), multicast, shared memory."""
    block_m, block_n, multicast = tiling["block_m"], tiling["block_n"], tiling["multicast"]
    stage_options = (8, 7, 6, 5, 4, 3, 2, 1)
    if 128 % block_n and 128 // math.gcd(128, block_n) <= 4:  # DeepGEMM's bound on its unrolled code
        stage_options = (4, 3, 2, 1)
    fitting = [(s, smem_config(s, k, block_m, block_n)) for s in stage_options if s <= max(k // 128, 1)]
    fitting = [(s, smem) for s, smem in fitting if smem[0] <= SMEM_BYTES]
    if not fitting:
        raise ValueError(f"DeepGEMM tiling {tiling} does not fit shared memory at K = {k}")
    stages, smem = fitting[0]
    cluster = 2 if multicast else 1
    tiles = -(-m // block_m) * -(-n // block_n)
    per_wave = -(-tiles // -(-tiles // num_sms))  # the fewest programs that still take every tile in as many waves
    programs = -(-per_wave // cluster) * cluster
    return programs, block_m, block_n, stages, (cluster, multicast == "a"), smem
