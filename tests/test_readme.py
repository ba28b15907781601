"""README-as-test: every command and every TOML block in README.md runs, shrunk to a few steps,
and every recipe key, table, component name, CLI flag and path the prose names exists.

How blocks are read, shrunk and marked is described in the README's "README commands are tests"
note (keep the two in step). Steps run in README order in one working folder (a copy of
``train_configs/`` and ``run_train.sh``, plus the ``my_texts/`` folder the README's own-text
example uses), so a command may use what an earlier one wrote (``runs/debug``); the session's
data cache is shared, so the stdlib corpus is built once.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.readme_blocks import (
    MARKERS,
    SHELL,
    Block,
    Command,
    Readme,
    commands,
    is_setup,
    toml_target,
)

README = Readme.read(REPO / "README.md")

# Appended to every command of a kind (the last value of a key or flag wins), so each runs in
# seconds; the README's contributor note lists the same.
SHRINK = {
    "train": ["--training.steps=2", "--eval.tokens=1024"],
    "bench": ["--steps", "1", "--warmup", "0"],
    "eval": ["--tokens", "1024"],
}


def shrink(cmd: Command) -> list[str]:
    argv = cmd.argv
    if Path(argv[0]).name == "run_train.sh":
        return [*argv, *SHRINK["train"]]
    if argv[0] == "kiln" and len(argv) > 1:
        return [*argv, *SHRINK.get(argv[1], [])]
    return argv


def _steps() -> list:
    """(kind, payload) per runnable piece of the README, in order, as pytest params."""
    later = " ".join(b.text for b in README.blocks if b.lang in SHELL)
    params = []
    for block in README.blocks:
        where = f"L{block.line}"
        if block.marker == "skip":
            params.append(pytest.param("skip", block, id=f"{where}-skipped",
                                       marks=pytest.mark.skip(reason=block.why)))
        elif block.lang in SHELL:
            for cmd in commands(block):
                if not is_setup(cmd):
                    params.append(pytest.param("command", cmd, id=cmd.label()))
        elif block.lang == "toml" and block.marker != "toml-only":
            target = toml_target(block)
            kind = "save" if target in later else "train"  # a later command trains it
            params.append(pytest.param(kind, block, id=f"{where}-{kind}-{target}"))
    return params


STEPS = _steps()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    shutil.copytree(REPO / "train_configs", work / "train_configs",
                    ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
    shutil.copy2(REPO / "run_train.sh", work / "run_train.sh")
    (work / "scripts").symlink_to(REPO / "scripts")
    _own_texts(work / "my_texts")
    return work


def _own_texts(folder: Path) -> None:
    """A reader's own text: the documentation of a few stdlib modules (~150 kB)."""
    import pydoc

    folder.mkdir()
    for name in ("json", "textwrap", "collections", "argparse", "email", "http"):
        module = __import__(name)
        (folder / f"{name}.txt").write_text(pydoc.render_doc(module, renderer=pydoc.plaintext))


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    bin_dir = str(Path(sys.executable).parent)  # this environment's `kiln` and `python`
    full = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            **(env or {})}
    full.pop("KILN_ERROR_DIR", None)
    out = subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=1800)
    return out.returncode, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("kind,item", STEPS)
def test_readme_step(kind, item, workdir):
    if kind == "command":
        cmd: Command = item
        argv = shrink(cmd)
        status, output = run(argv, workdir, cmd.env)
        assert status == cmd.expect, f"{shlex.join(argv)} -> {status}\n{output}"
        return
    block: Block = item
    target = workdir / toml_target(block)
    shipped = (REPO / toml_target(block)).exists()
    assert not shipped, f"README L{block.line} would overwrite the shipped {target.name}"
    target.write_text(block.text)
    if kind == "train":
        argv = ["kiln", "train", str(target.relative_to(workdir)), *SHRINK["train"],
                f"--run.folder=runs/readme_{block.line}"]
        status, output = run(argv, workdir)
        assert status == 0, f"{shlex.join(argv)} -> {status}\n{output}"


def test_readme_has_steps_and_justified_markers():
    assert sum(1 for p in STEPS if p.values[0] == "command") >= 5
    for block in README.blocks:
        if block.marker:
            assert block.marker in MARKERS, f"L{block.line}: unknown marker {block.marker!r}"
            assert len(block.why.split()) >= 3, f"L{block.line}: say why ({block.marker}: ...)"
        if block.lang == "toml":
            tomllib.loads(block.text)  # every TOML block parses, marked or not


# ------------------------------------------------------------------------ names in the prose
def _configs(kind: str) -> set[type]:
    from kiln.components import registry

    return {entry.config for entry in registry.entries(kind)}


def _walk(classes: set[type], parts: list[str]) -> bool:
    """Whether ``parts`` (a dotted recipe key or table; UPPERCASE parts are placeholders) names
    a key of one of ``classes``, descending into sub-tables and components of any type."""
    if not parts:
        return True
    part, rest = parts[0], parts[1:]
    for cls in classes:
        fields = {info.alias or name: info for name, info in cls.model_fields.items()}
        for info in fields.values() if part.isupper() else [fields.get(part)]:
            if info is not None and _walk_field(info, rest):
                return True
    return False


def _walk_field(info, rest: list[str]) -> bool:
    from kiln.recipes.resolve import _kind_of, _nested_config, _nested_list

    kind, container = _kind_of(info.annotation, info.metadata)
    if kind and container:  # a table of named components: [optimizers.NAME]
        return not rest or _walk(_configs(kind), rest[1:])
    if kind:
        return _walk(_configs(kind), rest)
    nested = _nested_config(info.annotation) or _nested_list(info.annotation)
    if nested is not None:
        return _walk({nested}, rest)
    return not rest


# Dotted names that are files or parameter names (`model.safetensors`, `norm.weight`), not keys.
NOT_KEYS = (".toml", ".json", ".jsonl", ".safetensors", ".py", ".npy", ".bin", ".md", ".sh",
            ".weight", ".bias", ".model", ".tiktoken")


# Components the README's own Python examples register (`@register("attention", "linear")`).
EXAMPLE_NAMES = {name for block in README.blocks if block.lang == "python"
                 for name in __import__("re").findall(r'@register\("\w+", "([\w-]+)"\)',
                                                      block.text)}


# Files the README's own TOML blocks create (`# train_configs/my_recipe.toml`).
README_FILES = {toml_target(b) for b in README.blocks if b.lang == "toml"}


def name_problems(span: str) -> list[str]:
    """What is wrong with the names in one inline code span of the README ([] if nothing)."""
    import re

    from kiln.components import registry
    from kiln.recipes.schema import Recipe

    problems = []
    tables = set(Recipe.model_fields)
    keys = re.findall(r"--([a-z_]+(?:\.[\w]+)+)=", span)
    table = re.fullmatch(r"\[([A-Za-z_.]+)\]", span)
    if table:
        keys.append(table.group(1))
    dotted = re.fullmatch(r"([a-z_]+(?:\.[\w]+)+)", span)
    if dotted and dotted.group(1).split(".")[0] in tables and not span.endswith(NOT_KEYS):
        keys.append(dotted.group(1))
    for key in keys:
        if not _walk({Recipe}, key.split(".")):
            problems.append(f"recipe key {key!r} does not exist (see `kiln list`)")
    for name in re.findall(r'type\s*=\s*"([\w-]+)"', span):
        if name not in EXAMPLE_NAMES and not any(name in registry.names(k)
                                                 for k in registry.kinds()):
            problems.append(f"component {name!r} is not registered (see `kiln list`)")
    if span.startswith("kiln "):
        problems += _cli_problems(span)
    path = (span.split() or [""])[0].rstrip(":,")
    if re.match(r"(train_configs|scripts|docs|recipes|components|parallelisms|checkpointing|"
                r"tests)/", path) and not re.search(r"[*<]", path) and path not in README_FILES \
            and not (REPO / path).exists():
        problems.append(f"{path} does not exist")
    return problems


def _cli_problems(span: str) -> list[str]:
    import argparse
    import importlib

    from kiln.recipes.cli import COMMANDS

    words = span.split()
    if words[1] not in COMMANDS:
        return [f"`kiln {words[1]}` is not a command ({', '.join(COMMANDS)})"]
    parser = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[words[1]][0]).add_arguments(parser)
    flags = set()
    todo = [parser]
    while todo:
        p = todo.pop()
        for action in p._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()
    used = [w.strip("[]") for w in words if w.strip("[").startswith("--") and "=" not in w]
    return [f"`kiln {words[1]}` has no option {f}" for f in used if f not in flags]


def test_names_in_the_readme_exist():
    problems = [f"`{span}`: {p}" for span in README.inline_code() for p in name_problems(span)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("span,bad", [
    ("--trainig.steps=5", True), ("[optimizers.NAME]", False), ("[training.stepp]", True),
    ("parallelism.compile", False), ("optimizer.no_decay.ndim", False), ('type = "mamba"', True),
    ("kiln bench RECIPE [--steps N]", False), ("kiln bench --stepz 3", True),
    ("kiln fly", True), ("train_configs/nope.toml", True), ("model.safetensors", False),
    ("checkpoint.async", False), ("--SECTION.KEY=VALUE", False), ("norm.weight", False),
])
def test_the_name_checks_catch_mistakes(span, bad):
    assert bool(name_problems(span)) == bad, name_problems(span)


def test_python_blocks_import_what_they_use():
    import ast
    import importlib

    for block in README.blocks:
        if block.lang != "python" or block.marker == "skip":
            continue
        tree = ast.parse(block.text)  # the block is valid Python
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"L{block.line}: {node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
