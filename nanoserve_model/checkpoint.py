"""Where a checkpoint's tensors are: which safetensors file holds each, and its shape, read from the
files' headers (no tensor data). A sharded checkpoint names its files in model.safetensors.index.json,
and then only those files, and in each only the tensors the index gives it, belong to the checkpoint."""
import json
from pathlib import Path

from safetensors import safe_open

INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json", INDEX)  # what describes a checkpoint, weights aside


class SafetensorsCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX
        self.index: Path | None = index if index.exists() else None
        weight_map = self._weight_map() if self.index else None
        files = sorted({self.path / name for name in weight_map.values()}) if weight_map else self._all_files()
        self.files: dict[str, Path] = {}         # tensor name -> its file
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}         # tensor name -> safetensors dtype name (BF16, F8_E4M3, ...)
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as tensors:
                for name in tensors.keys():
                    if weight_map is None or weight_map.get(name) == file.name:
                        stored = tensors.get_slice(name)
                        self.files[name], self.shapes[name] = file, tuple(stored.get_shape())
                        self.dtypes[name] = stored.get_dtype()
        if weight_map and (unheld := sorted(weight_map.keys() - self.files.keys())):
            raise ValueError(f"{self.index}: tensor {unheld[0]!r} is mapped to {weight_map[unheld[0]]}, which "
                             f"does not hold it ({len(unheld)} such tensor(s))")

    @property
    def source(self) -> str:
        """What to name in an error about the checkpoint as a whole."""
        return str(self.index or self.path)

    def by_file(self) -> dict[Path, list[str]]:
        """Tensor names grouped by file, files in order, so each file is opened once."""
        grouped: dict[Path, list[str]] = {}
        for name, file in sorted(self.files.items(), key=lambda item: (item[1], item[0])):
            grouped.setdefault(file, []).append(name)
        return grouped

    def _weight_map(self) -> dict[str, str]:
        weight_map = read_index(self.index)
        for name in sorted(set(weight_map.values())):
            if not (self.path / name).is_file():
                raise ValueError(f"{self.index}: names {name}, which is not in {self.path}")
        return weight_map

    def _all_files(self) -> list[Path]:
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt*"))
            hint = f" ({other[0]} and other PyTorch pickles are not read: convert them to safetensors)" if other else ""
            raise ValueError(f"{self.path}: no *.safetensors files{hint}; --load-format dummy serves random weights")
        return files


def read_index(index: Path) -> dict[str, str]:
    """An index's `weight_map`: tensor name -> file name."""
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{index}: not a safetensors index (no `weight_map`: {err!r})") from None


def weight_files(path: Path) -> list[str]:
    """The files (glob patterns) a checkpoint's weights are read from: those its index names, else every
    *.safetensors file. A Hub repository may hold more (a consolidated copy beside the shards): only these
    are fetched."""
    index = path / INDEX
    return sorted(set(read_index(index).values())) if index.exists() else ["*.safetensors"]
