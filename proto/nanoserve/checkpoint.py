"""Files a local checkpoint directory must hold, checked before anything slow starts (weights, other
processes), with the missing file named: the worker needs config.json, the scheduler tokenizer.json."""
from pathlib import Path

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the flag and the file."""


def check_files(directory: str | Path, names: tuple[str, ...], flag: str) -> None:
    """Raises CheckpointError unless `directory` is a directory holding every file in `names`."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{flag} {directory}: no such directory")
    missing = [name for name in names if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{flag} {directory} has no {' and no '.join(missing)}: a checkpoint directory "
                              f"holds config.json, tokenizer.json and *.safetensors")
