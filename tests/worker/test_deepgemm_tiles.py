"""DeepGEMM's tiles as the tuner chooses them (nanoserve_kernels/deepgemm_tiles.py): which tilings are tried,
the config DeepGEMM is handed for one, and that a tiling reaches only the calls made inside `forced` on the
forcing thread. DeepGEMM's config module is stood in (no CUDA build of it here)."""
import sys
import threading
import types

import pytest

from nanoserve_kernels import deepgemm_tiles

SMS = 132


def waves(rows: int, n: int, tiling: dict) -> int:
    return -(-(-(-rows // tiling["block_m"]) * -(-n // tiling["block_n"])) // SMS)


def test_candidates_take_few_waves_and_a_multicast_only_where_there_is_a_neighbour():
    for rows, n in ((64, 4096), (128, 6144), (256, 4096), (128, 24576), (192, 4096)):
        tried = deepgemm_tiles.candidates(rows, n, SMS)
        counts = {waves(rows, n, t) for t in tried}
        assert tried and max(counts) - min(counts) <= deepgemm_tiles.EXTRA_WAVES
        assert all(t["block_m"] < 2 * max(64, rows) for t in tried)  # no tile as tall as twice the rows
        for t in tried:
            m_blocks, n_blocks = -(-rows // t["block_m"]), -(-n // t["block_n"])
            assert m_blocks * n_blocks > (waves(rows, n, t) - 1 + deepgemm_tiles.LAST_WAVE_FULL) * SMS
            assert t["multicast"] != "b" or m_blocks >= 2
            assert t["multicast"] != "a" or n_blocks >= 2
    assert {t["multicast"] for t in deepgemm_tiles.candidates(64, 4096, SMS)} == {"", "a"}  # one row block
    gate_up = deepgemm_tiles.candidates(256, 24576, SMS)  # 1 x 192 tiles of 256 x 128 take two waves, the fewest
    assert {waves(256, 24576, t) for t in gate_up} == {2, 3}
    assert {"block_m": 128, "block_n": 128, "multicast": "b"} in gate_up


def smem_config(stages: int, k: int, block_m: int, block_n: int) -> tuple[int, int, int]:
    """A stand-in for DeepGEMM's shared-memory count: the output tile and each stage's operand tiles."""
    return block_m * block_n * 2 + stages * (block_m + block_n) * 128, 128, 0


@pytest.fixture
def fake_deep_gemm(monkeypatch) -> types.SimpleNamespace:
    calls = []

    def heuristic(m, n, k, num_groups, num_sms, *args, **kwargs):
        calls.append("heuristic")
        return "deepgemm's own"
    dg_gemm = types.SimpleNamespace(get_best_configs=heuristic, get_smem_config=smem_config)
    jit_kernels = types.SimpleNamespace(gemm=dg_gemm)
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(jit_kernels=jit_kernels))
    monkeypatch.setitem(sys.modules, "deep_gemm.jit_kernels", jit_kernels)
    monkeypatch.setitem(sys.modules, "deep_gemm.jit_kernels.gemm", dg_gemm)
    deepgemm_tiles._install.cache_clear()
    yield dg_gemm
    deepgemm_tiles._install.cache_clear()


def test_a_forced_tiling_gives_deepgemm_its_tile_stages_and_multicast(fake_deep_gemm):
    tiling = {"block_m": 128, "block_n": 64, "multicast": "b"}
    with deepgemm_tiles.forced(tiling):
        programs, block_m, block_n, stages, multicast, smem = fake_deep_gemm.get_best_configs(256, 4096, 4096, 1, SMS)
    assert (block_m, block_n, multicast) == (128, 64, (2, False))  # the weight tile shared by two row blocks
    assert programs == 128 and programs % 2 == 0  # 2 x 64 tiles in one wave, in pairs
    assert stages == 8 and smem == smem_config(8, 4096, 128, 64)  # the most that fit
    with deepgemm_tiles.forced({"block_m": 256, "block_n": 160, "multicast": "a"}):
        programs, _, _, stages, multicast, smem = fake_deep_gemm.get_best_configs(256, 4096, 4096, 1, SMS)
    assert multicast == (2, True) and programs == 26  # 26 tiles, an even count of programs
    assert stages == 2 and smem[0] <= deepgemm_tiles.SMEM_BYTES < smem_config(3, 4096, 256, 160)[0]
    never_fits = lambda *args: (deepgemm_tiles.SMEM_BYTES + 1, 0, 0)  # noqa: E731
    with pytest.raises(ValueError, match="does not fit shared memory"):
        deepgemm_tiles._configs(never_fits, 256, 4096, 4096, SMS, tiling)

def test_a_tiling_reaches_only_calls_inside_forced_on_the_forcing_thread(fake_deep_gemm):
    tiling = {"block_m": 64, "block_n": 64, "multicast": ""}
    elsewhere = []
    with deepgemm_tiles.forced(tiling):
        assert fake_deep_gemm.get_best_configs(128, 4096, 4096, 1, SMS)[1:3] == (64, 64)
        thread = threading.Thread(target=lambda: elsewhere.append(fake_deep_gemm.get_best_configs(128, 4096, 4096,
                                                                                                  1, SMS)))
        thread.start()
        thread.join()
        assert fake_deep_gemm.get_best_configs(128, 4096, 4096, 4, SMS) == "deepgemm's own"  # a grouped GEMM
    assert elsewhere == ["deepgemm's own"]
    assert fake_deep_gemm.get_best_configs(128, 4096, 4096, 1, SMS) == "deepgemm's own"  # after it
    with deepgemm_tiles.forced(None):  # the table gave no tiling: DeepGEMM's own
        assert fake_deep_gemm.get_best_configs(128, 4096, 4096, 1, SMS) == "deepgemm's own"
