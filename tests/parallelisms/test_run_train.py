"""Acceptance: `NGPU=2 ./run_train.sh train_configs/debug.toml` trains with FSDP2 on CPU, and two
launches on one host form one 4-rank job (torchrun's c10d rendezvous), with the one-process
losses. The 2-rank run is forked (tests/forked.py: the ranks get torchrun's variables); the
launcher itself, torchrun included, runs for real in the two-node test here and in
tests/recipes/runs/test_launch.py."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests import forked
from tests.conftest import REPO

# The launch is under test, not the model: debug.toml at a quarter of its width and length.
NARROW = ("--model.dim=64", "--model.ffn.hidden_dim=128", "--training.seq_len=64")


def _cmd(folder, *extra: str) -> list[str]:
    return ["./run_train.sh", "train_configs/debug.toml", *NARROW, "--training.steps=5",
            "--training.micro_batch=4", f"--run.folder={folder}", "--run.log_interval=1",
            "--run.progress_bar=false", "--checkpoint.enable=false", "--eval.interval=0",
            "--eval.at_end=false", *extra]


def _train(tmp_path, ngpu: int, *extra: str) -> str:
    env = {**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"}
    out = forked.run(_cmd(tmp_path / str(ngpu), *extra), REPO, env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> str:
    """The one-process run both launches are compared with (NGPU unset: run_train.sh runs the
    kiln command itself, here forked from the test server)."""
    out = forked.run(_cmd(tmp_path_factory.mktemp("one")), REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"step +\d+/5 +loss ([0-9.]+)", log)]


@pytest.mark.slow
def test_ngpu2_runs_fsdp2_on_cpu(tmp_path, one):
    # with the chunked loss too: FSDP2 gathers the (tied) head weight inside forward
    two = _train(tmp_path, 2, "--parallelism.activation_checkpoint=selective",
                 "--training.loss_chunk_tokens=200")
    assert "FSDP2 over 2 ranks (shard 2 x replicate 1)" in two
    assert "activation checkpointing selective every 2nd block (2 of 4)" in two
    assert "init: replica then shard (equals single-process init)" in two
    assert "single process" in one
    assert len(_losses(two)) == 5
    assert _losses(two) == pytest.approx(_losses(one), abs=2e-4)  # 4-decimal log lines


@pytest.mark.slow
def test_two_nodes_on_localhost_train_like_one_process(tmp_path, one):
    """Issue 14 item 6: two `run_train.sh` launches (NNODES=2, NODE_RANK 0 and 1, torchrun's c10d
    rendezvous on 127.0.0.1) of 2 processes each form one 4-rank job (tensor parallel 2 x FSDP2 2
    across the "nodes"), with the single-process losses."""
    from tests.parallelisms.tiny import free_port

    args = _cmd(tmp_path / "nodes", "--parallelism.tp=2")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node in (0, 1):
        env = {**os.environ, "NGPU": "2", "NNODES": "2", "NODE_RANK": str(node),
               "RDZV_ENDPOINT": endpoint, "RDZV_ID": f"kiln-test-{tmp_path.name}",
               "OMP_NUM_THREADS": "1"}
        nodes.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "tensor parallel 2" in logs[0] and "FSDP2 over 2 ranks" in logs[0], logs[0][-3000:]
    assert len(_losses(logs[0])) == 5
    assert _losses(logs[0]) == pytest.approx(_losses(one), abs=2e-4)  # 4-decimal log lines


def test_several_nodes_need_a_rendezvous_endpoint():
    env = {**os.environ, "NGPU": "2", "NNODES": "2"}
    env.pop("RDZV_ENDPOINT", None)
    out = subprocess.run(["./run_train.sh", "train_configs/debug.toml"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "RDZV_ENDPOINT=host:port" in out.stderr
