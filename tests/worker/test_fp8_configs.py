"""The FP8 launch table's lookup: a device's own entries first, then those of a device of its architecture
(an H200 served with the H100's choices where it has none of its own), else the untuned default."""
import json

from nanoserve_kernels import fp8_configs
from nanoserve_kernels.fp8_configs import ARCHITECTURES, SCALED_MM, TRITON, W8A8, Fp8Choice, tuned

TUNED, SIBLING, OTHER_ARCH = "Tuned GPU", "Sibling GPU", "Older GPU"


def entry(backend: str, us: float) -> dict:
    return dict(mode=W8A8, backend=backend, launch={}, us=us, bf16_us=2 * us)


TABLES = {
    ARCHITECTURES: {TUNED: "sm_90", SIBLING: "sm_90", OTHER_ARCH: "sm_80"},
    TUNED: {"64x128": {"256": entry(TRITON, 1.0), "4096": entry(SCALED_MM, 9.0)}},
    SIBLING: {"64x128": {"256": entry(TRITON, 2.0)}},
    OTHER_ARCH: {"64x128": {"8192": entry(TRITON, 5.0)}},
}


def test_a_device_takes_its_own_entry_then_one_of_its_architecture():
    assert tuned(SIBLING, 64, 128, 256, tables=TABLES).us == 2.0  # its own, though the other was faster
    assert tuned(SIBLING, 64, 128, 4096, tables=TABLES).us == 9.0  # none of its own: the sibling's
    assert tuned(SIBLING, 64, 128, 8192, tables=TABLES) is None  # another architecture's is not taken
    assert tuned(OTHER_ARCH, 64, 128, 4096, tables=TABLES) is None
    assert tuned(SIBLING, 64, 128, 4096, silu_mul=True, tables=TABLES) is None  # another shape
    assert tuned("Unrecorded GPU", 64, 128, 4096, tables=TABLES) is None  # architecture unknown: default


def test_the_committed_table_records_the_architecture_of_every_device_it_holds():
    tables = json.loads(fp8_configs.CONFIG_FILE.read_text())
    devices = set(tables) - {ARCHITECTURES}
    assert devices and devices == set(tables[ARCHITECTURES])
    assert all(arch.startswith("sm_") for arch in tables[ARCHITECTURES].values())


def test_an_h200_serves_the_buckets_it_was_not_tuned_at_with_the_h100_choices():
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    tables = json.loads(fp8_configs.CONFIG_FILE.read_text())
    for shape, buckets in tables[h100].items():
        for rows in set(buckets) - set(tables[h200].get(shape, {})):
            n, k = map(int, shape.removesuffix("+silu").split("x"))
            assert tuned(h200, n, k, int(rows), shape.endswith("+silu")) == Fp8Choice(**buckets[rows])
