"""What tests/test_readme.py appends to a docs page's commands so that each runs in seconds
(docs/contributing.md, "Docs are tests", lists the same)."""

from __future__ import annotations

from pathlib import Path

from tests.readme_blocks import Command

TASK_LIMIT = 16  # examples of a downstream task (in-loop [evals.NAME] or `kiln eval`'s)
# Appended to every command of a kind (the last value of a key or flag wins).
# Two sequences a step, one per micro-batch (debug.toml takes 8): the same commands, less work.
BATCH = ["--training.global_batch=2", "--training.micro_batch=1"]
SHRINK = {
    "train": ["--training.steps=2", "--eval.tokens=1024", *BATCH],
    "bench": ["--steps", "1", "--warmup", "0", *BATCH],
    "eval": ["--tokens", "1024", "--limit", str(TASK_LIMIT)],
    "sweep": BATCH,  # every run's override; --emit writes a job file and runs nothing
    # every size's override, and a thousandth of the tokens (--flops ladders: see shrink())
    "ladder": [*BATCH, "--checkpoint.enable=false", "--eval.tokens=256"],
    "mup": ["--steps", "1", "--batch", "1", "--seq-len", "16"],
    "fit": ["--bootstrap", "100"],
}
LADDER_TOKENS = ["--tokens-per-param", "0.001"]
# ... and of 64 tokens, unless the recipe trains on conversations, preference pairs or prompts: a
# conversation longer than seq_len is dropped, not cut, so a shorter window would leave the chat
# and preference recipes no data.
SHORT = {"train": ["--training.seq_len=64", "--eval.tokens=256"],
         "bench": ["--training.seq_len=64"], "sweep": ["--training.seq_len=64"],
         "ladder": ["--training.seq_len=64"]}


def shrink(cmd: Command, workdir: Path) -> list[str]:
    argv = cmd.argv
    if Path(argv[0]).name == "run_train.sh":
        return [*argv, *SHRINK["train"], *shorter("train", argv[1:], workdir)]
    if argv[0] == "kiln" and len(argv) > 1 and "--emit" not in argv:
        tokens = LADDER_TOKENS if argv[1] == "ladder" and "--flops" not in argv else []
        return [*argv, *SHRINK.get(argv[1], []), *tokens, *shorter(argv[1], argv[2:], workdir)]
    return argv


def shorter(kind: str, args: list[str], workdir: Path) -> list[str]:
    """SHORT[kind] for a command training the recipe ``args[0]`` on packed text (none for chat
    data, other commands, or a recipe that does not load: the command itself says why), and
    the first TASK_LIMIT examples of each of its in-loop downstream tasks."""
    from kiln.components.errors import KilnError
    from kiln.recipes.config.files import load_recipe

    if kind not in SHORT or not args or not (workdir / args[0]).is_file():
        return []
    try:
        recipe = load_recipe(workdir / args[0])
    except KilnError:
        return []
    tasks = [f"--evals.{name}.limit={TASK_LIMIT}" for name in recipe.evals or {}]
    chat = recipe.data.type in ("chat", "preference", "prompts")
    return tasks + ([] if chat else SHORT[kind])
