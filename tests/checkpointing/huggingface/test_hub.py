"""Hub upload with rotation and download-and-resume, offline: uploads go through an injected
API object that writes a local "remote" laid out as the Hugging Face cache; downloads use the
real ``huggingface_hub`` in offline mode against that cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kiln.checkpointing import layout
from kiln.checkpointing.huggingface import hub
from kiln.checkpointing.manager import CheckpointManager
from kiln.components.distributed import World
from kiln.components.errors import CheckpointError
from tests.checkpointing.toy import toy_state

COMMIT = "0" * 40


class FolderApi:
    """The HfApi methods kiln uses, backed by a folder in the Hugging Face cache layout."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.calls: list[str] = []

    def _snapshot(self, repo_id: str) -> Path:
        repo = self.cache / ("models--" + repo_id.replace("/", "--"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(COMMIT)
        return repo / "snapshots" / COMMIT

    def create_repo(self, repo_id, private=True, exist_ok=True):
        self.calls.append(f"create {repo_id} private={private}")
        self._snapshot(repo_id).mkdir(parents=True, exist_ok=True)

    def upload_folder(self, *, repo_id, folder_path, path_in_repo, commit_message=""):
        self.calls.append(f"upload {path_in_repo}")
        shutil.copytree(folder_path, self._snapshot(repo_id) / path_in_repo, dirs_exist_ok=True)

    def list_repo_files(self, repo_id):
        root = self._snapshot(repo_id)
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())

    def delete_folder(self, path_in_repo, *, repo_id, commit_message=""):
        self.calls.append(f"delete {path_in_repo}")
        shutil.rmtree(self._snapshot(repo_id) / path_in_repo)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def _train_and_upload(tmp_path, api, steps=3, keep=2):
    sync = hub.HubSync("me/run", keep=keep, api=api, log=lambda s: None)
    s = toy_state()
    m = CheckpointManager(tmp_path / "local", World(0, 1, 0, torch.device("cpu")),
                          keep_last=0, on_publish=sync.upload_checkpoint, log=lambda s: None)
    losses = []
    for _ in range(steps):
        losses.append(s.train_step())
        m.save(s)
    sync.wait()
    assert sync.errors == []
    return s, losses


def test_upload_rotates_old_checkpoints(tmp_path, offline_cache):
    api = FolderApi(offline_cache)
    _train_and_upload(tmp_path, api, steps=3, keep=2)
    assert hub.remote_checkpoints(api.list_repo_files("me/run")) == ["step_0000002",
                                                                     "step_0000003"]
    assert "delete checkpoints/step_0000001" in api.calls
    assert api.calls[0] == "create me/run private=True"


def test_download_and_resume_offline_through_huggingface_hub(tmp_path, offline_cache):
    from huggingface_hub import HfApi

    api = FolderApi(offline_cache)
    s, _ = _train_and_upload(tmp_path, api, steps=3)
    expected = [s.train_step() for _ in range(2)]
    real = HfApi()  # offline: reads the cache written above, no network
    folder = hub.download("hf://me/run", api=real)  # newest, found in the cache
    assert folder.name == "step_0000003" and layout.is_complete(folder)
    assert hub.download("hf://me/run/step_0000002", api=real).name == "step_0000002"
    fresh = toy_state(seed=8)
    CheckpointManager(tmp_path / "other", World(0, 1, 0, torch.device("cpu")),
                      log=lambda s: None).load(fresh, folder)
    assert [fresh.train_step() for _ in range(2)] == expected


def test_failed_uploads_are_reported_not_fatal(tmp_path):
    class Down(FolderApi):
        def upload_folder(self, **kw):
            raise ConnectionError("no route to host")

    lines = []
    sync = hub.HubSync("me/run", api=Down(tmp_path), log=lines.append)
    sync.upload_checkpoint(tmp_path)
    sync.wait()
    assert "no route to host" in sync.errors[0] and "warning" in lines[-1]


@pytest.mark.parametrize("spec", ["hf://me", "hf://me/run/latest", "hf:///run"])
def test_bad_specs(spec):
    with pytest.raises(CheckpointError):
        hub.parse_spec(spec)


def test_token_is_read_from_the_environment_and_not_logged(monkeypatch, capsys):
    monkeypatch.setenv("KILN_TEST_TOKEN", "hf_secret_value")
    api = hub.make_api("KILN_TEST_TOKEN")
    assert api.token == "hf_secret_value"
    assert "hf_secret_value" not in capsys.readouterr().out
