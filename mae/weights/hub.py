"""Weights to the Hugging Face Hub: an hf folder (`mae export --format hf-folder`: timm's config.json, the weights,
a model card) uploaded with `huggingface_hub`, so `timm.create_model("hf-hub:OWNER/NAME", pretrained=True)` loads it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mae.errors import CheckpointError, ConfigError
from mae.run_folder import HF_CONFIG, HF_WEIGHTS

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_token() -> str:
    """The Hub token: HF_TOKEN, or the one a prior `hf auth login` stored; ConfigError saying how to get one."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise ConfigError(
            "--push_to_hub: no Hugging Face token; set HF_TOKEN (a write token from "
            "https://huggingface.co/settings/tokens) or run `hf auth login`"
        )
    return token


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload an hf folder to the model repo `repo_id` (created when missing; `revision`, a branch, too);
    returns the commit's URL."""
    if not _REPO_ID.match(repo_id):
        raise ConfigError(f"--push_to_hub {repo_id}: expected OWNER/NAME (letters, digits, - _ .)")
    folder = Path(folder)
    if not (folder / HF_CONFIG).is_file() or not (folder / HF_WEIGHTS).is_file():
        raise CheckpointError(f"{folder}: not an hf folder (no {HF_CONFIG} and {HF_WEIGHTS}); write it with mae export")
    from huggingface_hub import HfApi

    api = HfApi(token=hub_token())
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        revision=revision,
        commit_message=commit_message or f"Upload {folder.name} with mae export",
    )
    return str(getattr(commit, "commit_url", commit))
