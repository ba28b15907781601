"""`kiln sweep`: grid parsing and folder names, bad keys refused before anything runs, finished
runs skipped and partial ones continued, the SLURM job-array script (run with stand-in srun /
scontrol / run_train.sh), and one real sweep of two tiny runs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.cli import main
from kiln.recipes.runs.sweep import expand, parse_grid, split_values
from tests import forked
from tests.conftest import CONFIGS
from tests.recipes.run_folders import make_run
from tests.recipes.runs.test_launch import _alive, gone_within

DEBUG = str(CONFIGS / "debug.toml")


def test_grid_values_points_and_folder_names(tmp_path):
    assert split_values("[0.9, 0.95],[0.9,0.99], \"a,b\"") == [
        "[0.9, 0.95]", "[0.9,0.99]", "\"a,b\""]
    grid = parse_grid(["optimizer.lr=1e-3,3e-3", "model.attention.type=causal,differential"],
                      seeds=2, base_seed=5)
    assert grid[-1] == ("training.seed", ["5", "6"])
    points = expand(grid, tmp_path)
    assert len(points) == 8
    assert points[0].folder.name == "lr=1e-3,type=causal,seed=5"
    assert points[0].overrides[:3] == ["--optimizer.lr=1e-3", "--model.attention.type=causal",
                                       "--training.seed=5"]
    names = expand(parse_grid(["model.dim=8,16", "model.ffn.dim=1"]), tmp_path)
    assert names[0].folder.name == "model-dim=8,ffn-dim=1"  # dots: never read as an override
    betas = expand(parse_grid(["optimizer.betas=[0.9, 0.95]"]), tmp_path)
    assert betas[0].folder.name == "betas=_0.9__0.95_"


@pytest.mark.parametrize("spec, message", [
    ("optimizer.lr", "write KEY=V1,V2"),
    ("optimizer.lr=1e-3,,2e-3", "an empty value"),
    ("optimizer.lr=1e-3,1e-3", "listed twice"),
])
def test_bad_grids(spec, message):
    with pytest.raises(RecipeError, match=message):
        parse_grid([spec])
    with pytest.raises(RecipeError, match="at least one --grid"):
        parse_grid([])


def test_unknown_key_is_refused_with_did_you_mean_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", DEBUG, "--grid", "optimizer.lrr=1e-3,3e-3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown key optimizer.lrr" in err and "did you mean 'lr'" in err
    assert not out.exists()


POINTS = ("lr=1e-3", "lr=3e-3")  # the grid optimizer.lr=1e-3,3e-3 in folder sw


def _made_runs(cwd: Path) -> Path:
    """Each point's finished run folder (a recipe and metrics, as make_run writes them for the
    point's folder), kept in cwd/made for a stand-in run to copy into place."""
    made = cwd / "made"
    made.mkdir()
    for name in POINTS:
        make_run(cwd / "sw" / name).rename(made / name)
    (cwd / "sw").rmdir()
    return made


def _fake_run_train(cwd: Path) -> Path:
    """A run_train.sh that logs its arguments and puts its point's finished run folder in place
    (copied: a stand-in has no need of a Python that imports torch)."""
    made = _made_runs(cwd)
    script = cwd / "run_train.sh"
    script.write_text(f"""#!/bin/bash
echo "$@" >> {cwd}/calls.txt
for a in "$@"; do case "$a" in --run.folder=*) f="${{a#--run.folder=}}";; esac; done
f="${{f%\\"}}"; f="${{f#\\"}}"
mkdir -p "$f" && cp -r "{made}/$(basename "$f")/." "$f/"
echo '{{"step": 30, "eval/mc/acc": 0.5, "eval/mc/acc_norm": 0.4, "eval/mc/examples": 8}}' \
    >> "$f/metrics.jsonl"
exit ${{FAIL:-0}}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _table(out: str) -> list[str]:
    """The comparison table's first block: its header line and the two runs' lines."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["run"])
    return lines[start:start + 3]


@pytest.mark.slow
def test_sweep_runs_each_point_once_and_skips_finished_ones(tmp_path, monkeypatch, capsys):
    _fake_run_train(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[3]))
    monkeypatch.setenv("NGPU", "2")  # several processes: through ./run_train.sh
    args = ["sweep", DEBUG, "--grid", "optimizer.lr=1e-3,3e-3", "--out", "sw",
            "--training.steps=5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 and "--training.steps=5 --optimizer.lr=1e-3" in calls[0]
    assert "lr=1e-3,3e-3" not in out and "starts in sw/lr=1e-3" in out
    table = _table(out)
    assert table[0].split()[:2] == ["run", "steps"]  # the comparison table
    assert "mc acc" in "".join(out.splitlines()) and "acc_norm" not in out  # a column per task
    assert out.splitlines()[-1].startswith("kiln sweep: ")  # the verdict follows the table
    done = json.loads((tmp_path / "sw" / "lr=1e-3" / "sweep_done.json").read_text())
    assert done["overrides"] == ["--optimizer.lr=1e-3"]
    assert main(args) == 0
    assert "finished; skipped" in capsys.readouterr().out
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 2  # nothing ran again
    (tmp_path / "sw" / "lr=3e-3" / "sweep_done.json").unlink()  # as if it had been killed
    monkeypatch.setenv("FAIL", "3")
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "lr=3e-3 continues in" in captured.out
    assert "failed runs (rerun the sweep to continue them)" in captured.err
    assert "exit 3" in captured.err


@pytest.mark.slow
def test_slurm_script_runs_a_task_with_stand_in_slurm_tools(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node7\necho node8\n")
    (bin_dir / "srun").write_text("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                                  "SLURM_NODEID=0 exec \"$@\"\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    _fake_run_train(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", DEBUG, "--grid", "optimizer.lr=1e-3,3e-3", "--out", "sw",
                 "--emit", "slurm", "--training.steps=5"]) == 0
    assert "submit: sbatch sw/sweep.sbatch" in capsys.readouterr().out
    script = tmp_path / "sw" / "sweep.sbatch"
    text = script.read_text()
    assert "#SBATCH --array=0-1" in text and not (tmp_path / "calls.txt").exists()
    # --output is relative to the job's working folder: the one the sweep was emitted from
    assert f"#SBATCH --chdir={tmp_path}\n" in text
    assert text.index("#SBATCH --chdir=") < text.index("#SBATCH --output=sw/")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": "1",
           "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_JOB_NUM_NODES": "2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    subprocess.run(["bash", str(script)], env=env, check=True, cwd="/")
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 1 and "--optimizer.lr=3e-3" in calls[0]
    assert (tmp_path / "sw" / "lr=3e-3" / "sweep_done.json").is_file()
    done = subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True,
                          text=True)
    assert "is finished; skipped" in done.stdout


@pytest.mark.slow
def test_a_real_sweep_of_two_tiny_runs(tmp_path):
    # one process: the trainer in a subprocess, here forked from the forked sweep
    env = {k: v for k, v in os.environ.items() if k != "NGPU"}
    tiny = ["--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
            "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--training.global_batch=2",
            "--training.micro_batch=2", "--run.log_interval=1", "--eval.interval=0",
            "--eval.tokens=128", "--data.max_bytes=200000", "--checkpoint.enable=false",
            "--run.progress_bar=false", "--evals.mc.type=multiple_choice",
            f"--evals.mc.path={CONFIGS / 'tasks' / 'python_mc.jsonl'}", "--evals.mc.limit=8",
            '--evals.mc.choice_prefix=""']
    done = forked.run(["kiln", "sweep", DEBUG, "--grid", "optimizer.lr=1e-3,1e-2", "--grid",
                       "training.steps=2", "--out", "sw", *tiny], tmp_path, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = _table(done.stdout)
    assert table[0].split()[:3] == ["run", "lr", "steps"]
    assert table[1].split()[:3] == ["lr=1e-3,steps=2", "0.001", "2"]
    assert "kiln sweep: no verdict on eval loss" in done.stdout  # one eval batch: no error
    assert "mc acc (n=8)" in done.stdout and "±" in done.stdout  # the task's error bars
    assert "kiln sweep: winner on mc acc" in done.stdout or (
        "kiln sweep: no winner on mc acc" in done.stdout)


@pytest.mark.slow
def test_a_sweep_killed_with_kill_9_takes_its_training_run_along(tmp_path):
    script = tmp_path / "run_train.sh"  # a stand-in training run: its PID, then it waits
    script.write_text(f"#!/bin/bash\necho $$ > {tmp_path}/child.pid\nexec sleep 600\n")
    script.chmod(0o755)
    env = {**os.environ, "NGPU": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    sweep = subprocess.Popen([sys.executable, "-m", "kiln.recipes.cli", "sweep", DEBUG, "--grid",
                              "optimizer.lr=1e-3,3e-3", "--out", "sw"], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL)
    pid_file = tmp_path / "child.pid"
    deadline = time.monotonic() + 120
    while not pid_file.is_file() or not pid_file.read_text().strip():
        assert sweep.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        sweep.kill()
        sweep.wait()
        assert gone_within([child], 5)
    finally:
        if _alive(child):
            os.kill(child, 9)


@pytest.mark.slow
def test_two_sweeps_of_one_grid_share_its_points(tmp_path):
    """Each point trains once (a stand-in run holding kiln.lock until the test lets it end);
    neither sweep counts the other's points as failed, and both end with every point done."""
    made = _made_runs(tmp_path)
    script = tmp_path / "run_train.sh"
    script.write_text(f"""#!/bin/bash
for a in "$@"; do case "$a" in --run.folder=*) f="${{a#--run.folder=}}";; esac; done
f="${{f%\\"}}"; f="${{f#\\"}}"
echo "$f" >> {tmp_path}/calls.txt
exec {sys.executable} -c "
import pathlib, shutil, sys, time
from kiln.recipes.runs.lock import RunLock
lock = RunLock.take(sys.argv[1])  # exits 2 when held, as kiln train does
while not pathlib.Path('{tmp_path}/release').exists():
    time.sleep(0.05)
shutil.copytree('{made}/' + pathlib.Path(sys.argv[1]).name, sys.argv[1], dirs_exist_ok=True)" "$f"
""")
    script.chmod(0o755)
    env = {**os.environ, "NGPU": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    cmd = [sys.executable, "-m", "kiln.recipes.cli", "sweep", DEBUG, "--grid",
           "optimizer.lr=1e-3,3e-3", "--out", "sw"]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (tmp_path / "calls.txt").is_file():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    second = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    seen = [""]
    while "another sweep" not in seen[-1] and "[2/2]" not in seen[-1]:  # at the first point
        seen.append(second.stdout.readline())
        assert seen[-1], seen  # the second sweep ended
    (tmp_path / "release").touch()  # both runs may end now
    assert "[1/2] sw/lr=1e-3 is being trained by another sweep (kiln sweep, PID" in seen[-1]
    out, err = first.communicate(timeout=300)
    second_err = second.communicate(timeout=300)[1]
    assert (first.returncode, second.returncode) == (0, 0), (err, second_err)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 2  # each point once
    assert all((tmp_path / "sw" / p / "sweep_done.json").is_file()
               for p in ("lr=1e-3", "lr=3e-3"))
    assert not list((tmp_path / "sw").glob("*/sweep.lock"))
