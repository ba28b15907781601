"""The inline option settings of README.md and docs/*.md name real options and valid values,
and the command lines there name flags their command takes (docs are code: a value the recipe
loader would reject, or a flag the command line would, is a bug in the page)."""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel

from kiln.components import registry
from kiln.recipes.config import schema
from tests.conftest import REPO
from tests.readme_blocks import doc_pages

SETTING = re.compile(r"`([a-z_][a-z0-9_.]*) = ([^`]+)`")


def _config_classes() -> list[type[BaseModel]]:
    """Every recipe table and registered component config, and the configs nested in them."""
    todo = [schema.Recipe, *(e.config for e in registry.entries())]
    seen: list[type[BaseModel]] = []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for field in cls.model_fields.values():
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
    return seen


def _fields() -> dict[str, set[str] | None]:
    """Field name -> its allowed string values (None: free, some class takes any value)."""
    seen: dict[str, list[set[str] | None]] = {}
    for cls in _config_classes():
        for name, field in cls.model_fields.items():
            ann = field.annotation
            literal = typing.get_origin(ann) is typing.Literal
            seen.setdefault(name, []).append(set(typing.get_args(ann)) if literal else None)
    fields = {name: None if None in kinds else set().union(*kinds)
              for name, kinds in seen.items()}
    # The recipe loader's own top-level keys (recipes/config/loader.py), not fields of any table.
    return fields | {"extends": None, "remove": None}


def readme_settings() -> list[tuple[str, str, str]]:
    """(page, key, value) of every inline `key = value` of every page."""
    return [(path.relative_to(REPO).as_posix(), key, value) for path in doc_pages(REPO)
            for key, value in SETTING.findall(path.read_text(encoding="utf-8"))]


def test_readme_settings_name_real_options_and_valid_values():
    fields = _fields()
    found = readme_settings()
    assert len(found) >= 5
    assert {page for page, _, _ in found} > {"README.md", "docs/parallelism.md"}
    bad = []
    for page, key, value in found:
        name = key.rsplit(".", 1)[-1]
        if name not in fields:
            bad.append(f"{page}: `{key} = {value}`: no option {name!r} (see `kiln list`)")
            continue
        choices = fields[name]
        values = [v.strip('"') for v in value.split("|")] if "|" in value or \
            value.startswith('"') else []
        for v in values:
            if choices is not None and "<" not in v and v not in choices:
                bad.append(f"{page}: `{key} = {value}`: {v!r} is not one of {sorted(choices)}")
    assert not bad, "\n".join(bad)


def test_the_check_catches_an_invalid_value():
    fields = _fields()
    assert "paper" not in fields["lambda_mode"] and "reparam" in fields["lambda_mode"]
    assert fields["activation_checkpoint"] == {"none", "full", "selective"}


COMMAND_LINE = re.compile(r"kiln ([a-z]+)\b([^`\n]*)")
FLAG = re.compile(r"(?<![\w.-])(--[a-z][a-z0-9-]*)(?![\w.-])")  # not a --section.key override


def _command_flags() -> dict[str, set[str]]:
    """Each kiln command's options, from its own ``add_arguments`` (the CLI builds them
    lazily); a command with a parser of its own (``kiln harness``) is left out."""
    import argparse
    import importlib

    from kiln.recipes.cli import COMMANDS

    flags = {}
    for name, (module_name, _) in COMMANDS.items():
        module = importlib.import_module(module_name)
        if getattr(module, "RAW_ARGS", False):
            continue
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        flags[name] = _options(parser)
    return flags


def _options(parser) -> set[str]:
    """A parser's options and its subcommands' (``kiln data prepare --out``)."""
    import argparse

    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def test_docs_name_real_command_flags():
    """`kiln CMD ... --flag` in README.md and docs/*.md: CMD takes --flag (a renamed option
    leaves no page behind)."""
    flags = _command_flags()
    found, bad = 0, []
    for path in doc_pages(REPO):
        for cmd, rest in COMMAND_LINE.findall(path.read_text(encoding="utf-8")):
            for flag in FLAG.findall(rest) if cmd in flags else []:
                found += 1
                if flag not in flags[cmd] and flag != "--k":  # (README's `[--k=v ...]`)
                    bad.append(f"{path.relative_to(REPO)}: `kiln {cmd} ... {flag}`: "
                               f"kiln {cmd} has no {flag}")
    assert found >= 20 and not bad, "\n".join(bad)


INLINE_COMMAND = re.compile(r"`(kiln [a-z]+(?: [^`\n]*)?)`")


def test_docs_inline_command_lines_parse():
    """A whole inline `kiln CMD ARGS` of README.md and docs/*.md parses as its command line
    would (every required argument there: `kiln plot RUN --metrics ...` without its `--out`
    was refused). Left out: spans with placeholders for several forms (`[...]`, `...`, `|`),
    and a command or its flags named in prose (`kiln data mix`, `kiln eval RUN --tasks`)."""
    import argparse
    import contextlib
    import importlib
    import io
    import shlex

    from kiln.recipes.cli import COMMANDS, _split_overrides

    parsed, bad = 0, []
    for path in doc_pages(REPO):
        for line in INLINE_COMMAND.findall(path.read_text(encoding="utf-8")):
            words = shlex.split(line)
            module_name = COMMANDS.get(words[1], (None,))[0]
            if module_name is None or any(c in line for c in "[]|<>…") or "..." in line:
                continue
            module = importlib.import_module(module_name)
            if getattr(module, "RAW_ARGS", False):
                continue
            parser = argparse.ArgumentParser(prog=f"kiln {words[1]}")
            module.add_arguments(parser)
            subcommands = {name for action in parser._actions  # `kiln data mix`, `mup check`
                           if not action.option_strings and action.choices
                           for name in action.choices}
            args = words[3:] if words[2:3] and words[2] in subcommands else words[2:]
            if all(w.startswith("-") or w.isupper() for w in args):
                continue  # the command, or its flags, named in prose (`kiln eval RUN --tasks`)
            _, rest = _split_overrides(parser, words[2:])
            try:
                with contextlib.redirect_stderr(io.StringIO()) as err:
                    parser.parse_args(rest)
                parsed += 1
            except SystemExit:
                bad.append(f"{path.relative_to(REPO)}: `{line}`: {err.getvalue().strip()}")
    assert parsed >= 15 and not bad, "\n".join(bad)
