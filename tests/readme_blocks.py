"""Reading README.md and docs/*.md for tests/test_readme.py: fenced blocks, their markers,
commands, and the inline names (recipe keys, tables, component names, CLI flags, paths) the
prose mentions.

The rules the pages follow are in docs/contributing.md ("Docs are tests"); this module is their
implementation.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# A fenced block, also indented (inside a list item): its language and body.
FENCE = re.compile(r"^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<what>[\w-]+)\s*(?::\s*(?P<why>.*?))?\s*-->", re.S)
MARKERS = ("skip", "toml-only")
SHELL = ("bash", "sh", "shell", "console")
# Commands the pages show but the docs test leaves to CI or to the reader's setup.
SETUP = ("pip", "pytest", ".ci/run")
EXPECT = re.compile(r"#\s*exits?\s+(\d+)\b")


@dataclass
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    marker: str = ""  # "", "skip" or "toml-only"
    why: str = ""
    output: str = ""  # a shell block's next block when it is ```text: its last command's output


@dataclass
class Command:
    line: int
    env: dict[str, str]
    argv: list[str]
    expect: int = 0
    output: str = ""  # what it prints (``output_problem``), for the last command of a block

    @property
    def program(self) -> str:
        return self.argv[0]

    def label(self) -> str:
        prefix = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"L{self.line}: {prefix + ' ' if prefix else ''}{shlex.join(self.argv)}"


def doc_pages(repo: Path) -> list[Path]:
    """The pages whose blocks run and whose names are checked: README.md, then every docs/*.md
    (a new page is picked up without registering it anywhere)."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


@dataclass
class Page:
    text: str
    blocks: list[Block] = field(default_factory=list)
    name: str = "README.md"  # relative to the repository: README.md, docs/data.md

    @property
    def stem(self) -> str:
        """Short name for generated files and test ids: ``readme``, ``data``."""
        return Path(self.name).stem.lower()

    @classmethod
    def read(cls, path: Path, repo: Path | None = None) -> Page:
        name = path.relative_to(repo).as_posix() if repo else path.name
        return cls.parse(path.read_text(encoding="utf-8"), name)

    @classmethod
    def parse(cls, text: str, name: str = "README.md") -> Page:
        readme = cls(text, name=name)
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip().rsplit("\n", 1)[-1]
            marker = MARKER.fullmatch(before.strip())
            indent = len(m.group(1))
            body = "".join(line[indent:] if line[:indent].isspace() else line
                           for line in m.group(3).splitlines(keepends=True))
            readme.blocks.append(Block(
                lang=m.group(2).lower(), text=body, line=text.count("\n", 0, m.start()) + 1,
                marker=marker.group("what") if marker else "",
                why=(marker.group("why") or "").strip() if marker else "",
            ))
            if len(readme.blocks) > 1:  # ```text right after a shell block: its output
                prev, this = readme.blocks[-2], readme.blocks[-1]
                between = text[:m.start()].rsplit("```", 1)[-1]
                if this.lang == "text" and prev.lang in SHELL and not between.strip():
                    prev.output = this.text
        return readme

    def prose(self) -> str:
        """The page without its fenced blocks (inline code lives here)."""
        return FENCE.sub("", self.text)

    def inline_code(self) -> list[str]:
        return re.findall(r"`([^`\n]+)`", self.prose())

    def links(self) -> list[str]:
        """Targets of the page's Markdown links (``[text](target)``), outside code."""
        prose = re.sub(r"`[^`\n]+`", "", self.prose())
        return re.findall(r"\]\(([^()\s]+)\)", prose)

    def anchors(self) -> set[str]:
        """The ``#fragment`` each heading gets on GitHub: lowercase, punctuation dropped,
        spaces to hyphens."""
        out = set()
        for heading in re.findall(r"(?m)^#{1,6} +(.+?) *$", self.prose()):
            out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
        return out


Readme = Page  # the README is the first page


def commands(block: Block) -> list[Command]:
    """The shell commands of a block: continuation lines joined, comments dropped, each
    ``a && b`` part its own command. A trailing ``# exits N`` says the expected status."""
    out: list[Command] = []
    lines = block.text.split("\n")
    i = 0
    while i < len(lines):
        start = i
        line = lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        expect = EXPECT.search(line)
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if not words:
                continue
            bad = [w for w in words if w in ("|", ";", ">", "<", "&") or w.startswith((">", "|"))]
            if bad:
                raise ValueError(f"line {block.line + start + 1}: {part.strip()!r} uses "
                                 f"{bad[0]!r}; the docs test runs plain commands (split them, "
                                 "or mark the block)")
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words:
                out.append(Command(block.line + start + 1, env, words,
                                   int(expect.group(1)) if expect else 0))
    if out:
        out[-1].output = block.output
    return out


NUMBER = r"\d[\d,]*(?:\.\d+)?"


def output_problem(expected: str, printed: str) -> str:
    """Whether ``printed`` (a command's stdout) has the shape of a page's example output: line
    by line equal, except that every number matches any number, ``...`` inside a line any
    text, and a line that is only ``...`` any number of lines. "" if it matches."""
    pattern = ""
    for line in expected.rstrip("\n").split("\n"):
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
            continue
        for piece in re.split(rf"(\.\.\.|{NUMBER})", line):
            pattern += (".*?" if piece == "..." else NUMBER if re.fullmatch(NUMBER, piece)
                        else re.escape(piece))
        pattern += r"\n"
    if re.fullmatch(pattern, printed.rstrip("\n") + "\n"):
        return ""
    return f"printed:\n{printed}\ndoes not match the example (numbers aside):\n{expected}"


def is_setup(cmd: Command) -> bool:
    """Install and test-suite commands: CI runs them, the README test does not."""
    argv = cmd.argv
    if argv[0] in SETUP or argv[0].endswith(".ci/run"):
        return True
    return argv[0].startswith("python") and argv[1:3] in (["-m", "pytest"], ["-m", "pip"])


def toml_target(block: Block, stem: str = "readme") -> str:
    """Where a TOML block is saved: the path its first line names (``# train_configs/x.toml``),
    else ``train_configs/<page>_<line>.toml`` (next to debug.toml, so ``extends`` resolves)."""
    first = block.text.lstrip().split("\n", 1)[0]
    m = re.fullmatch(r"#\s*(\S+\.toml)\b.*", first.strip())
    return m.group(1) if m else f"train_configs/{stem}_{block.line}.toml"
