"""Hugging Face Hub: upload checkpoints (keeping the newest N) and the final export; download a
checkpoint to resume from.

Repository layout: ``checkpoints/step_XXXXXXX/...`` (one folder per checkpoint, as on disk) and
``export/...`` (``kiln export`` output). The token comes from the environment variable named by
``checkpoint.hub_token_env`` and is handed to ``HfApi`` only, never printed. The API object can
be injected (anything with ``HfApi``'s methods), which is how the tests run without a network.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from kiln.checkpointing import layout
from kiln.components.errors import CheckpointError

PREFIX = "checkpoints/"


def make_api(token_env: str = "HF_TOKEN"):
    from huggingface_hub import HfApi

    return HfApi(token=os.environ.get(token_env) or None)


class HubSync:
    """Uploads in a background thread, one at a time (rank 0 only)."""

    def __init__(self, repo_id: str, *, keep: int = 2, private: bool = True, api=None,
                 token_env: str = "HF_TOKEN", log=print) -> None:
        self.repo_id = repo_id
        self.keep = keep
        self.private = private
        self.api = api if api is not None else make_api(token_env)
        self.log = log
        self._thread: threading.Thread | None = None
        self._created = False
        self.errors: list[str] = []

    def upload_checkpoint(self, folder: Path) -> None:
        self._start(self._upload_checkpoint, Path(folder))

    def upload_export(self, folder: Path) -> None:
        self._start(self._upload_export, Path(folder))

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _start(self, fn, folder: Path) -> None:
        self.wait()  # at most one upload in flight
        self._thread = threading.Thread(target=self._guarded, args=(fn, folder),
                                        name="kiln-hub-upload", daemon=True)
        self._thread.start()

    def _guarded(self, fn, folder: Path) -> None:
        try:
            fn(folder)
        except Exception as exc:  # the run goes on; the local checkpoint is intact
            msg = f"upload of {folder.name} to {self.repo_id} failed: {type(exc).__name__}: {exc}"
            self.errors.append(msg)
            self.log(f"kiln: warning: {msg}")

    def _ensure_repo(self) -> None:
        if not self._created:
            self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
            self._created = True

    def _upload_checkpoint(self, folder: Path) -> None:
        self._ensure_repo()
        self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder),
                               path_in_repo=PREFIX + folder.name,
                               commit_message=f"kiln checkpoint {folder.name}")
        self.log(f"kiln: uploaded {folder.name} to hf://{self.repo_id}")
        self.rotate()

    def _upload_export(self, folder: Path) -> None:
        self._ensure_repo()
        self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder),
                               path_in_repo="export", commit_message="kiln export")
        self.log(f"kiln: uploaded the export to hf://{self.repo_id}/export")

    def rotate(self) -> list[str]:
        """Delete all but the newest ``keep`` uploaded checkpoints."""
        if self.keep <= 0:
            return []
        names = remote_checkpoints(self.api.list_repo_files(self.repo_id))
        stale = names[:-self.keep]
        for name in stale:
            self.api.delete_folder(PREFIX + name, repo_id=self.repo_id,
                                   commit_message=f"kiln: rotate out {name}")
        if stale:
            self.log(f"kiln: removed {', '.join(stale)} from hf://{self.repo_id}")
        return stale


def remote_checkpoints(files: list[str]) -> list[str]:
    """Checkpoint folder names in a repo's file list, oldest first (complete ones only: a
    manifest is uploaded with every checkpoint)."""
    names = {f[len(PREFIX):].split("/")[0] for f in files
             if f.startswith(PREFIX) and f.endswith("/" + layout.MANIFEST)}
    return sorted((n for n in names if layout.step_of(n) is not None), key=layout.step_of)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``hf://OWNER/NAME[/step_XXXXXXX]`` -> (repo id, checkpoint name or None)."""
    parts = spec.removeprefix("hf://").strip("/").split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise CheckpointError(
            f"checkpoint.resume = {spec!r}: expected hf://OWNER/NAME or "
            "hf://OWNER/NAME/step_XXXXXXX"
        )
    name = parts[2] if len(parts) == 3 else None
    if name is not None and layout.step_of(name) is None:
        raise CheckpointError(f"{spec}: {name!r} is not a checkpoint name (step_XXXXXXX)")
    return f"{parts[0]}/{parts[1]}", name


def download(spec: str, api=None, token_env: str = "HF_TOKEN") -> Path:
    """Fetch one checkpoint (the newest when none is named) into the Hugging Face cache; return
    its local folder. Works offline (``HF_HUB_OFFLINE=1``) from a populated cache."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    api = api if api is not None else make_api(token_env)
    repo_id, name = parse_spec(spec)
    if name is None:
        try:
            names = remote_checkpoints(api.list_repo_files(repo_id))
        except OfflineModeIsEnabled:
            names = None  # offline: take whatever the cache holds
        if names == []:
            raise CheckpointError(f"{spec}: the repo holds no kiln checkpoints")
        name = names[-1] if names else None
    pattern = f"{PREFIX}{name}/*" if name else f"{PREFIX}*"
    root = Path(api.snapshot_download(repo_id, allow_patterns=[pattern])) / PREFIX.rstrip("/")
    if name is None:
        found = layout.newest_complete(root)
        if found is None:
            raise CheckpointError(f"{spec}: no complete checkpoint in the local Hub cache")
        return found
    if not (root / name).is_dir():
        raise CheckpointError(f"{spec}: {name} was not found in hf://{repo_id}")
    return root / name


MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt",
               "vocab.txt"]


def parse_model_spec(spec: str) -> tuple[str, str | None]:
    """``hf://OWNER/NAME[@REVISION]`` -> (repo id, revision or None)."""
    body, _, rev = spec.removeprefix("hf://").strip("/").partition("@")
    parts = body.split("/")
    if len(parts) != 2 or not all(parts) or (_ and not rev):
        raise CheckpointError(f"{spec!r}: expected hf://OWNER/NAME or hf://OWNER/NAME@REVISION")
    return body, rev or None


def download_model(spec: str, api=None, token_env: str = "HF_TOKEN") -> Path:
    """Fetch a model repository's config, safetensors and tokenizer files (no pickles) into the
    Hugging Face cache; return the local snapshot folder. Works offline from a populated cache
    (``HF_HUB_OFFLINE=1``)."""
    api = api if api is not None else make_api(token_env)
    repo_id, revision = parse_model_spec(spec)
    try:
        return Path(api.snapshot_download(repo_id, revision=revision,
                                          allow_patterns=MODEL_FILES))
    except Exception as exc:  # network, auth, missing repo or revision, incomplete cache
        raise CheckpointError(f"{spec}: cannot fetch the model ({type(exc).__name__}: {exc})"
                              ) from None
