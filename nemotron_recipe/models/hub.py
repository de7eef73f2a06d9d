"""`model.pretrained` as a Hugging Face hub id: the checkpoint directory it names in the usual HF cache.

A local directory is used as it is. A hub id ("org/name") is fetched with huggingface_hub's
`snapshot_download` into the cache (`HF_HOME` / `HF_HUB_CACHE`), which it reuses: an id already there
loads offline. Offline (`HF_HUB_OFFLINE=1`, or no network) with nothing cached, one error names the id,
the cache directory and the command that downloads it.

Every rank resolves the id itself; huggingface_hub's file locks make concurrent downloads into one
cache safe, and the ranks then read the same snapshot.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .nemotron_v3.config import ModelConfigError

# What a checkpoint is read from: config, weights and their index, tokenizer and chat template.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.py"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(value: str) -> bool:
    """Whether `value` reads as "org/name" and names no local path."""
    return bool(_REPO_ID.match(value)) and not Path(value).expanduser().exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def download_command(repo_id: str) -> str:
    """The shell line that fills the cache with `repo_id` (`hf download` is its newer spelling)."""
    return f"huggingface-cli download {repo_id}"


def resolve_pretrained(value: str, *, config_only: bool = False) -> str:
    """The local checkpoint directory `value` names: itself, or the cached snapshot of a hub id
    (downloaded when online). `config_only` fetches config.json alone (for planning a launch)."""
    if not is_hub_id(value):
        return value
    import huggingface_hub
    from huggingface_hub import constants, errors

    patterns = ["config.json"] if config_only else CHECKPOINT_PATTERNS
    cache = constants.HF_HUB_CACHE
    try:
        return huggingface_hub.snapshot_download(value, allow_patterns=patterns, local_files_only=_offline())
    except errors.GatedRepoError:
        raise ModelConfigError(
            f"model.pretrained={value!r}: the hub holds this model behind an access request. Fix: accept its "
            f"terms on huggingface.co/{value}, log in (`hf auth login`), then rerun or run `{download_command(value)}`."
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelConfigError(
            f"model.pretrained={value!r}: no such local directory, and no such model on the Hugging Face hub. "
            "Fix: point model.pretrained at a checkpoint directory or a hub model id such as "
            "nvidia/NVIDIA-Nemotron-Nano-9B-v2."
        ) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, OSError) as e:
        why = "HF_HUB_OFFLINE is set" if _offline() else f"the hub could not be reached ({type(e).__name__})"
        raise ModelConfigError(
            f"model.pretrained={value!r}: not in the Hugging Face cache ({cache}) and {why}. Fix: on a machine "
            f"with network run `{download_command(value)}` (or `hf download {value}`) with the same HF_HOME (or copy the cache there), "
            "or point model.pretrained at a downloaded checkpoint directory."
        ) from None
