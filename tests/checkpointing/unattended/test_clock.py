"""The wall clock: ``training.max_hours`` stops at a step boundary with a checkpoint early enough
for the save, the same command continues with identical losses; ``checkpoint.interval_minutes``
saves on time whatever the step rate. In-process runs use a fake clock that advances one second
per step (deterministic on a loaded machine); one slow test uses the real clock end to end."""

from __future__ import annotations

import io
import json
import re

import pytest

from kiln.checkpointing import hook
from kiln.checkpointing.unattended import clock
from kiln.checkpointing.unattended.clock import WallClock
from kiln.components.errors import RecipeError
from kiln.components.protocols import Hook
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.conftest import CONFIGS, REPO
from tests.parallelisms.tiny import free_port, init_gloo

TINY = [
    "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
    "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--training.global_batch=4",
    "--training.micro_batch=2", "--data.max_bytes=300000", "--data.eval_fraction=0.2",
    "--run.log_interval=1", "--run.progress_bar=false", "--run.tensorboard=false",
    "--eval.interval=0", "--eval.at_end=false", "--checkpoint.interval=0",
]


class FakeTime:
    """A clock that moves only when told: ``tick`` after every step."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Record(Hook):
    """Losses per step; advances the fake clock by ``step_s`` after every step."""

    def __init__(self, fake: FakeTime | None = None, step_s: float = 1.0):
        self.losses: dict[int, float] = {}
        self.fake, self.step_s = fake, step_s

    def on_step_end(self, trainer, result):
        self.losses[trainer.progress.step] = result.loss
        if self.fake is not None:
            self.fake.t += self.step_s


@pytest.fixture
def fake_clock(monkeypatch):
    """The checkpoint hook's clock reads a FakeTime and counts from the hook's creation."""
    fake = FakeTime()

    def make(*args, **kwargs):
        return WallClock(*args, now=fake, age_s=0.0, **kwargs)

    monkeypatch.setattr(hook, "WallClock", make)
    monkeypatch.setattr(hook, "estimate_save_s", lambda model: 0.5)
    return fake


def run(folder, *extra, fake=None, steps=12):
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, f"--training.steps={steps}",
                                                  f"--run.folder={folder}", *extra])
    rec, out = Record(fake), io.StringIO()
    trainer = Trainer(recipe, hooks=[rec], out=out)
    trainer.fit()
    return rec, trainer, out.getvalue()


# --------------------------------------------------------------------------- the decisions
def test_out_of_time_leaves_room_for_one_more_step_and_a_save():
    fake = FakeTime()
    c = WallClock(max_hours=10 / 3600, now=fake, age_s=2.0)  # 10 s, 2 s already gone
    c.begin()
    for _ in range(3):
        fake.t += 1.0
        c.step_done()
    assert c.elapsed() == 5.0 and max(c.steps) == 1.0
    assert not c.out_of_time(save_s=3.9)  # 5 + 1 + 3.9 < 10
    assert c.out_of_time(save_s=4.0)  # the save of a stop after one more step would not fit
    assert not WallClock(now=fake).out_of_time(save_s=1e9)  # no budget


def test_save_time_is_not_counted_as_step_time():
    fake = FakeTime()
    c = WallClock(max_hours=1.0, now=fake, age_s=0.0)
    c.begin()
    fake.t += 1.0
    c.step_done()
    fake.t += 30.0  # a 30 s save at that boundary, then a 1 s step
    c.saved(30.0)
    fake.t += 1.0
    c.step_done()
    assert list(c.steps) == [1.0, 1.0]


def test_interval_minutes_counts_from_the_last_save():
    fake = FakeTime()
    c = WallClock(interval_minutes=1.0, now=fake, age_s=0.0)
    fake.t += 59.0
    assert not c.save_due()
    fake.t += 1.0
    assert c.save_due()
    c.saved(2.0)
    assert not c.save_due()
    assert not WallClock(now=fake).save_due()


def test_process_age_is_measured_from_the_process_start():
    age = clock.process_age_s()
    assert 0.0 < age < 24 * 3600  # this pytest process started a while ago, not at boot


def test_max_hours_needs_checkpoints():
    with pytest.raises(RecipeError, match="checkpoint.enable = false"):
        load_recipe(CONFIGS / "debug.toml", ["--training.max_hours=1",
                                             "--checkpoint.enable=false"])


# ------------------------------------------------------------------ a run against the budget
def test_budget_stops_with_a_checkpoint_and_the_rerun_continues_identically(tmp_path,
                                                                         fake_clock):
    full, _, _ = run(tmp_path / "full", steps=12)
    # 7.2 s; 1 s a step (the first is timed from the start: 0 s); a save estimated at 0.5 s:
    # at step 7 (6 s gone) one more step and its save would end at 7.5 s > 7.2 s
    budget = "--training.max_hours=0.002"
    first, t1, log = run(tmp_path / "cut", budget, fake=fake_clock)
    stopped = max(first.losses)
    assert t1.stop_requested and stopped == 7, log
    assert re.search(rf"stopped at step {stopped} of 12 \(.*training.max_hours = 0.002", log)
    ck = tmp_path / "cut" / "checkpoints"
    assert (ck / f"step_{stopped:07d}").is_dir() and not (ck / "final").exists()
    fake_clock.t = 1000.0  # a new allocation
    second, _, _ = run(tmp_path / "cut", budget, fake=fake_clock)
    assert min(second.losses) == stopped + 1  # continued where the first stopped
    while not (ck / "final").exists():  # requeue until done, as a scheduler script would
        fake_clock.t = 1000.0
        more, _, _ = run(tmp_path / "cut", budget, fake=fake_clock)
        second.losses.update(more.losses)
    assert {**first.losses, **second.losses} == full.losses  # bit-identical, every step


def test_interval_minutes_saves_on_time_and_counts_in_keep_last(tmp_path, fake_clock):
    """3 s per step with a save every 0.1 min (6 s): every second step from the third (the
    step interval is 0 here), then the final save; keep_last 2 rotates them like the others."""
    rec = Record(fake_clock, step_s=3.0)
    recipe = load_recipe(CONFIGS / "debug.toml", [
        *TINY, "--training.steps=7", f"--run.folder={tmp_path}",
        "--checkpoint.interval_minutes=0.1", "--checkpoint.keep_last=2"])
    out = io.StringIO()
    Trainer(recipe, hooks=[rec], out=out).fit()
    saved = re.findall(r"checkpoint step (\d+) ->", out.getvalue())
    assert saved == ["3", "5", "7"], out.getvalue()
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000005", "step_0000007"]


# ---------------------------------------------------------------- 2 processes: rank 0 decides
def _agree_worker(rank: int, port: int, out: str) -> None:

    from kiln.components import distributed

    init_gloo(rank, 2, port)
    try:
        # rank 0 alone decides the clock flags; any rank's signal counts
        got = [clock.agree([rank == 1, rank == 0, rank == 1])]
        got.append(clock.agree([False, False, False]))
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(got, f)
    finally:
        distributed.shutdown()


@pytest.mark.slow
def test_every_rank_follows_the_same_decision(tmp_path):

    forked.spawn(_agree_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] == [[True, True, True], [False, False, False]]


# -------------------------------------------------------------------- the real clock, end to end
@pytest.mark.slow
def test_a_budget_of_seconds_stops_the_command_and_the_same_command_continues(tmp_path):
    """``kiln train --training.max_hours=...``: exit 0 with a checkpoint before the end, then the
    same command continues; the losses equal an uninterrupted run's (a constant schedule, so the
    total does not matter to the LR)."""
    args = ["kiln", "train", str(CONFIGS / "debug.toml"), *TINY, "--training.threads=1",
            "--optimizer.schedule.type=constant", f"--run.folder={tmp_path / 'cut'}"]
    cut = forked.run([*args, "--training.steps=100000", "--training.max_hours=0.002"], REPO)
    assert cut.returncode == 0, cut.stderr[-3000:]
    found = re.search(r"stopped at step (\d+) of 100000", cut.stdout)
    assert found, cut.stdout[-3000:]
    k = int(found.group(1))
    more = forked.run([*args, f"--training.steps={k + 2}"], REPO)
    assert more.returncode == 0 and "resumed from" in more.stdout, more.stderr[-3000:]
    full = forked.run([*args[:-1], f"--run.folder={tmp_path / 'full'}",
                        f"--training.steps={k + 2}"], REPO)
    assert full.returncode == 0, full.stderr[-3000:]

    def losses(folder):
        text = (tmp_path / folder / "metrics.jsonl").read_text()
        rows = [json.loads(x) for x in text.splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    assert losses("cut") == losses("full") and len(losses("full")) == k + 2
