"""Docs-as-test: every command and every TOML block of README.md and of every docs/*.md page
runs, shrunk to a few steps, and every recipe key, table, component name, CLI flag, path and
link the prose names exists.

How blocks are read, shrunk and marked is described in docs/contributing.md ("Docs are tests";
keep the two in step). Each page runs in order in its own working folder (a copy of
``train_configs/`` and ``run_train.sh``, plus the ``my_texts/`` folder of the own-text example),
so a command may use what an earlier one of the same page wrote (``runs/debug``); the session's
data cache is shared, so the stdlib corpus is built once.
"""

from __future__ import annotations

import difflib
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests import forked
from tests.conftest import REPO
from tests.readme_blocks import (
    MARKERS,
    SHELL,
    Block,
    Command,
    Page,
    commands,
    doc_pages,
    is_setup,
    output_problem,
    toml_target,
)
from tests.readme_shrink import BATCH, SHORT, SHRINK, shrink

PAGES = [Page.read(path, REPO) for path in doc_pages(REPO)]
README = PAGES[0]

def _steps(page: Page) -> list:
    """(page, kind, payload) per runnable piece of a page, in order, as pytest params."""
    later = " ".join(b.text for b in page.blocks if b.lang in SHELL)
    params = []
    for block in page.blocks:
        where = f"{page.name}:L{block.line}"
        if block.marker == "skip":
            params.append(pytest.param(page, "skip", block, id=f"{where}-skipped",
                                       marks=pytest.mark.skip(reason=block.why)))
        elif block.lang in SHELL:
            for cmd in commands(block):
                if not is_setup(cmd):
                    params.append(pytest.param(page, "command", cmd,
                                               id=f"{page.name}:{cmd.label()}"))
        elif block.lang == "toml" and block.marker != "toml-only":
            target = toml_target(block, page.stem)
            kind = "save" if target in later else "train"  # a later command trains it
            params.append(pytest.param(page, kind, block, id=f"{where}-{kind}-{target}"))
    return params


STEPS = [step for page in PAGES for step in _steps(page)]


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """page name -> its working folder, made on first use."""
    made: dict[str, Path] = {}

    def workdir(page: Page) -> Path:
        if page.name not in made:
            work = tmp_path_factory.mktemp(f"docs-{page.stem}")
            shutil.copytree(REPO / "train_configs", work / "train_configs",
                            ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
            shutil.copy2(REPO / "run_train.sh", work / "run_train.sh")
            (work / "scripts").symlink_to(REPO / "scripts")
            _own_texts(work / "my_texts")
            made[page.name] = work
        return made[page.name]

    return workdir


def _own_texts(folder: Path) -> None:
    """A reader's own text: the documentation of a few stdlib modules (~150 kB)."""
    import pydoc

    folder.mkdir()
    for name in ("json", "textwrap", "collections", "argparse", "email", "http"):
        module = __import__(name)
        (folder / f"{name}.txt").write_text(pydoc.render_doc(module, renderer=pydoc.plaintext))


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    """Run a page's command: a kiln command, run_train.sh (its NGPU ranks) or a Python script
    forked from the session's server (tests/forked.py: no torch import per process), anything
    else as its own process."""
    bin_dir = str(Path(sys.executable).parent)  # this environment's `kiln` and `python`
    full = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            **(env or {})}
    full.pop("KILN_ERROR_DIR", None)
    if forked.is_forkable(argv, {**(env or {}), "PATH": full["PATH"]}):  # `python`: this one
        return forked.run(argv, cwd, full, timeout=1800)
    return subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=1800)


def tail(out: subprocess.CompletedProcess) -> str:
    return out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.docs
@pytest.mark.parametrize("page,kind,item", STEPS)
def test_readme_step(page, kind, item, workdirs):
    workdir = workdirs(page)
    if kind == "command":
        cmd: Command = item
        argv = shrink(cmd, workdir)
        out = run(argv, workdir, cmd.env)
        assert out.returncode == cmd.expect, f"{shlex.join(argv)} -> {out.returncode}\n{tail(out)}"
        if cmd.output:
            problem = output_problem(cmd.output, out.stdout)
            assert not problem, f"{page.name} L{cmd.line}: {shlex.join(argv)}\n{problem}"
        return
    block: Block = item
    name = toml_target(block, page.stem)
    target = workdir / name
    shipped = (REPO / name).exists()
    assert not shipped, f"{page.name} L{block.line} would overwrite the shipped {target.name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.text)
    if kind == "train":
        train = Command(line=block.line, env={},
                        argv=["kiln", "train", str(target.relative_to(workdir))])
        argv = [*shrink(train, workdir), f"--run.folder=runs/{page.stem}_{block.line}"]
        out = run(argv, workdir)
        assert out.returncode == 0, f"{shlex.join(argv)} -> {out.returncode}\n{tail(out)}"


def test_the_shrink_shortens_packed_text_runs_and_keeps_conversations_whole():
    def argv(line: str) -> list[str]:
        return shrink(Command(line=1, env={}, argv=shlex.split(line)), REPO)

    assert argv("./run_train.sh train_configs/debug.toml")[-2:] == SHORT["train"]
    assert argv("kiln bench train_configs/llama_debug.toml")[-1] == "--training.seq_len=64"
    chat = argv("./run_train.sh train_configs/sft_debug.toml")
    assert "--training.seq_len=64" not in chat  # the recipe's own seq_len
    assert set(SHRINK["train"]) <= set(chat)
    # in-loop downstream tasks: their first examples only
    assert argv("./run_train.sh train_configs/dpo_debug.toml")[-1] == "--evals.restate.limit=16"
    assert argv("kiln train train_configs/nowhere.toml")[-1] == BATCH[-1]  # says so itself
    assert argv("kiln sweep train_configs/debug.toml --emit jobs.sh")[-1] == "jobs.sh"


def test_the_docs_pages_are_all_read():
    names = [page.name for page in PAGES]
    assert names[0] == "README.md" and "docs/design.md" in names
    assert sum(1 for p in STEPS if p.values[0] is README and p.values[1] == "command") >= 5


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_markers_are_known_and_justified(page):
    for block in page.blocks:
        where = f"{page.name} L{block.line}"
        if block.marker:
            assert block.marker in MARKERS, f"{where}: unknown marker {block.marker!r}"
            assert len(block.why.split()) >= 3, f"{where}: say why ({block.marker}: ...)"
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
    from kiln.recipes.config.resolve import _kind_of, _nested_config, _nested_list

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


# Components the pages' own Python examples register (`@register("attention", "linear")`).
EXAMPLE_NAMES = {name for page in PAGES for block in page.blocks if block.lang == "python"
                 for name in __import__("re").findall(r'@register\("\w+", "([\w-]+)"\)',
                                                      block.text)}


# Files the pages' own TOML blocks create (`# train_configs/my_recipe.toml`).
README_FILES = {toml_target(b, page.stem) for page in PAGES for b in page.blocks
                if b.lang == "toml"}


def name_problems(span: str) -> list[str]:
    """What is wrong with the names in one inline code span of a page ([] if nothing)."""
    import re

    from kiln.components import registry
    from kiln.recipes.config.schema import Recipe

    problems = []
    tables = set(Recipe.model_fields)
    keys = re.findall(r"--([a-z_]+(?:\.[\w]+)+)=", span)
    table = re.fullmatch(r"\[([A-Za-z_.]+)\]", span)
    # a recipe table, or a misspelt one; not any bracketed word (`[invalid]`, an output value)
    if table and difflib.get_close_matches(table.group(1).split(".")[0], tables, cutoff=0.8):
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
    if re.match(r"kiln \w", span) and not span.split()[1].endswith(":"):  # not `kiln x: error`
        problems += _cli_problems(span)
    path = (span.split() or [""])[0].rstrip(":,").split("(")[0]
    if re.match(r"(train_configs|scripts|docs|recipes|components|parallelisms|checkpointing|"
                r"tests)/", path) and not re.search(r"[*<]", path) and path not in README_FILES \
            and not _exists(path):
        problems.append(f"{path} does not exist")
    return problems


def _exists(path: str) -> bool:
    """A repository path, or an attribute of a module in it (`components/tasks/runner.run`)."""
    while True:
        if (REPO / path).exists() or (REPO / f"{path}.py").exists():
            return True
        if "." not in Path(path).name:
            return False
        path = path.rsplit(".", 1)[0]


def _cli_problems(span: str) -> list[str]:
    import argparse
    import importlib

    from kiln.recipes.cli import COMMANDS

    words = span.split()
    if words[1] not in COMMANDS:
        return [f"`kiln {words[1]}` is not a command ({', '.join(COMMANDS)})"]
    module = importlib.import_module(COMMANDS[words[1]][0])
    if getattr(module, "RAW_ARGS", False):  # its arguments go to another program (kiln harness)
        return []
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
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


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_names_in_the_pages_exist(page):
    problems = [f"`{span}`: {p}" for span in page.inline_code() for p in name_problems(span)]
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def link_problems(page: Page) -> list[str]:
    """Relative links of a page that point at no file, or at no heading of the page named."""
    by_name = {p.name: p for p in PAGES}
    here = (REPO / page.name).parent
    problems = []
    for link in page.links():
        if "://" in link or link.startswith("mailto:"):
            continue
        path, _, fragment = link.partition("#")
        target = (here / path).resolve() if path else REPO / page.name
        if not target.exists():
            problems.append(f"({link}): {path} does not exist")
            continue
        name = target.relative_to(REPO).as_posix() if target.is_relative_to(REPO) else ""
        if fragment and name in by_name and fragment not in by_name[name].anchors():
            problems.append(f"({link}): {name} has no heading #{fragment}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_in_the_pages_resolve(page):
    problems = link_problems(page)
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def test_example_output_is_matched_numbers_aside():
    page = Page.parse("```bash\nkiln x\n```\n\n```text\nbuilt in 0.1 s: .../d\n...\n"
                          "train on it: --x=1\n```\n")
    assert commands(page.blocks[0])[0].output == page.blocks[1].text
    expected = page.blocks[0].output
    assert output_problem(expected, "built in 12.5 s: /tmp/a/d\n  6 docs\n  more\n"
                                    "train on it: --x=2\n") == ""
    assert output_problem(expected, "built in 1 s: /tmp/a/d\ntrain on it: --x=2\n") == ""
    assert output_problem(expected, "made in 1 s: /tmp/d\ntrain on it: --x=2\n")
    assert output_problem(expected, "built in 1 s: /tmp/d\ntrain on it: --y=2\n")


def test_the_readme_links_every_docs_page():
    linked = {(REPO / link.partition("#")[0]).resolve() for link in README.links()}
    unlinked = [p.name for p in PAGES[1:] if (REPO / p.name).resolve() not in linked]
    assert not unlinked, f"add a row to README.md's Documentation table for {unlinked}"


def test_the_link_check_catches_a_moved_section():
    page = Page("See [data](docs/data.md#no-such-heading), [x](docs/nope.md) and "
                "[ok](docs/data.md) or [recipes](#recipes).\n\n## Recipes\n")
    assert link_problems(page) == [
        "(docs/data.md#no-such-heading): docs/data.md has no heading #no-such-heading",
        "(docs/nope.md): docs/nope.md does not exist",
    ]


@pytest.mark.parametrize("span,bad", [
    ("--trainig.steps=5", True), ("[optimizers.NAME]", False), ("[training.stepp]", True),
    ("parallelism.compile", False), ("optimizer.no_decay.ndim", False), ('type = "mamba"', True),
    ("kiln bench RECIPE [--steps N]", False), ("kiln bench --stepz 3", True),
    ("kiln fly", True), ("train_configs/nope.toml", True), ("model.safetensors", False),
    ("checkpoint.async", False), ("--SECTION.KEY=VALUE", False), ("norm.weight", False),
    ("[trainig]", True), ("[invalid]", False), ("kiln train: error: ", False),
    ("components/tasks/runner.run(task)", False), ("components/tasks/nope.run", True),
    ("kiln harness --model kiln --tasks x", False),
])
def test_the_name_checks_catch_mistakes(span, bad):
    assert bool(name_problems(span)) == bad, name_problems(span)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_python_blocks_import_what_they_use(page):
    import ast
    import importlib

    for block in page.blocks:
        if block.lang != "python" or block.marker == "skip":
            continue
        tree = ast.parse(block.text)  # the block is valid Python
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    where = f"{page.name} L{block.line}"
                    assert hasattr(module, alias.name), f"{where}: {node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
