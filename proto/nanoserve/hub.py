"""A `--model` (or `--tokenizer`) as a local directory: a directory is used as it is; a Hugging Face Hub
id (`Qwen/Qwen3-0.6B`) is fetched through huggingface_hub into its cache ($HF_HOME, or --download-dir),
only the files asked for, and read from there; with HF_HUB_OFFLINE=1 only the cache is looked at.

The worker asks for the config and weight files, the scheduler for the tokenizer files, so both resolve
one name the same way. huggingface_hub is imported only for a Hub id: clients of the contract package
and servers given a local directory never need it."""
import re
from pathlib import Path
from typing import Sequence

# owner/name (or a bare name), as the Hub spells repository ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class ModelNotFound(ValueError):
    """A model name that is neither a directory here nor a Hub repository that can be fetched."""


def resolve_model_dir(model: str, files: Sequence[str], revision: str = "", download_dir: str = "") -> Path:
    """The local directory holding `files` (glob patterns) of `model`. `revision` (branch, tag or commit)
    and `download_dir` (instead of huggingface_hub's cache) apply to Hub ids only."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not _HUB_ID.match(model) or model.startswith((".", "~")):
        raise ModelNotFound(f"model {model!r}: no such directory (a Hugging Face Hub id looks like owner/name)")
    return _download(model, list(files), revision or None, download_dir or None)


def _download(repo_id: str, files: list[str], revision: str | None, cache_dir: str | None) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise ModelNotFound(f"model {repo_id!r} is not a local directory, and reading it from the Hugging Face "
                            f"Hub needs the huggingface-hub package (pip install huggingface-hub)") from None
    where = f"model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                                      allow_patterns=files))
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"{where}: the Hugging Face Hub has no such revision") from None
    except errors.GatedRepoError:
        raise ModelNotFound(f"{where} is gated on the Hugging Face Hub: accept its terms there and set HF_TOKEN "
                            f"to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(f"{where}: no such directory here, and no such model on the Hugging Face Hub (a "
                            f"private one needs HF_TOKEN)") from None
    except errors.LocalEntryNotFoundError as err:
        if huggingface_hub.constants.is_offline_mode():
            cache = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
            raise ModelNotFound(f"{where} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
                                f"download it first (unset HF_HUB_OFFLINE, or `hf download {repo_id}`), or pass a "
                                f"directory") from None
        raise ModelNotFound(f"{where}: the Hugging Face Hub cannot be reached and the model is not in the "
                            f"cache ({type(err).__name__}: {err})") from None
    except errors.HfHubHTTPError as err:
        raise ModelNotFound(f"{where}: the Hugging Face Hub refused the download ({err})") from None
