"""Chat templates: a model's own Jinja template, or a named one, rendered as ``transformers``
renders it.

``transformers.apply_chat_template`` compiles a template in jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the loop-control extension, a ``{% generation %}`` tag
that records where assistant text is, and the globals ``raise_exception`` / ``strftime_now``,
with a ``tojson`` that keeps non-ASCII text; it passes ``messages``, ``add_generation_prompt``
and the special tokens' texts. kiln builds the same environment (not transformers itself: it
would import a large library into every data worker for one render call), and a test compares
the two on the stock templates kept as test data.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kiln.components.errors import DataError
from kiln.components.tokenizers.hf_tokenizer import configured_specials

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NAMED = {"chatml": CHATML}
TEMPLATE_FILE = "chat_template.jinja"  # beside a run and its export; transformers reads it
STOP_TEXTS = {"chatml": "<|im_end|>"}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")
SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass
class ChatTemplate:
    """A template's source and the special-token texts it is rendered with."""

    source: str
    name: str  # "chatml", or the file it came from
    specials: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...
    _compiled: Any = None

    @property
    def has_generation(self) -> bool:
        """Marks assistant text with ``{% generation %}`` (spans come from the render)."""
        return bool(_GENERATION.search(self.source))

    @property
    def adds_bos(self) -> bool:
        """A named template for kiln's tokenizers: the conversation starts with the tokenizer's
        BOS (a Hugging Face template writes its own ``bos_token``)."""
        return self.name in NAMED

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False,
               where: str = "") -> tuple[str, list[tuple[int, int]]]:
        """(text, the character spans ``{% generation %}`` marked). A template that fails is
        one error naming it and the example."""
        import jinja2

        if self._compiled is None:
            self._compiled = _compile(self.source, self.name)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with self._compiled.environment.activate_tracker(blocks, spans):
                for piece in self._compiled.generate(
                        messages=messages, add_generation_prompt=add_generation_prompt,
                        **self.specials):
                    blocks.append(piece)
        except jinja2.TemplateError as exc:
            raise DataError(f"chat template {self.name}: fails to render {where or 'a row'}: "
                            f"{exc}") from None
        return "".join(blocks), spans


def _compile(source: str, name: str) -> Any:
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: records where its text lands."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate)
            self._tracking: tuple[list[str], list] | None = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body) \
                .set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if self._tracking is not None:
                blocks, spans = self._tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        def activate(self, blocks, spans):
            import contextlib

            @contextlib.contextmanager
            def tracking():
                self._tracking = (blocks, spans)
                try:
                    yield
                finally:
                    self._tracking = None
            return tracking()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(f"chat template {name}: not valid Jinja (line {exc.lineno}: "
                        f"{exc.message}); fix the template or name another") from None


def from_folder(folder: Path) -> ChatTemplate:
    """The template of a Hugging Face model or tokenizer folder: ``chat_template.jinja``, or
    ``tokenizer_config.json``'s ``chat_template`` (the default one if it lists several)."""
    config_file = folder / "tokenizer_config.json"
    config: dict = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DataError(f"{config_file}: unreadable ({exc}); fix or remove it") from None
    # the texts templates see as bos_token / eos_token / pad_token, read as the tokenizer does
    specials = {f"{k}_token": v for k, v in configured_specials(folder).items()}
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(_read(jinja_file), str(jinja_file), specials)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise DataError(
            f"{folder}: no chat template (neither chat_template.jinja nor a chat_template in "
            "tokenizer_config.json); set data.template to a named template (\"chatml\") or to "
            "a .jinja file")
    return ChatTemplate(source, str(config_file), specials)


def from_text(source: str, name: str, tokenizer: Any = None) -> ChatTemplate:
    """A saved template (a run's ``chat_template.jinja``), under its name if it is a named one,
    else rendered with ``tokenizer``'s special tokens as the run rendered it (a template file
    writes ``eos_token``, which the run folder has no tokenizer_config.json to say)."""
    for known, text in NAMED.items():
        if text == source:
            return ChatTemplate(text, known)
    if tokenizer is None:
        return ChatTemplate(source, name)
    return _checked(ChatTemplate(source, name, tokenizer_specials(tokenizer)), tokenizer)


def resolve(spec: str, tokenizer: Any) -> ChatTemplate:
    """``data.template``: "" = the tokenizer's Hugging Face folder, a name in ``NAMED``, a
    .jinja file, or a folder."""
    if spec in NAMED:
        return ChatTemplate(NAMED[spec], spec)
    if spec:
        path = Path(spec).expanduser()
        if path.is_dir():
            return from_folder(path)
        if path.is_file():  # rendered with the tokenizer's special tokens, as transformers does
            return _checked(ChatTemplate(_read(path), str(path), tokenizer_specials(tokenizer)),
                            tokenizer)
        if path.suffix == ".jinja" or "/" in spec:  # meant as a path
            raise DataError(f"data.template = {spec!r}: no such file or folder (a .jinja "
                            "file, or a folder holding the tokenizer's chat template)")
        raise DataError(f"data.template = {spec!r}: not a named template "
                        f"({', '.join(NAMED)}), a .jinja file or a folder")
    file = getattr(tokenizer, "file", None)
    if file is None:
        raise DataError(
            f"data.template = \"\" reads the tokenizer's Hugging Face folder, but the "
            f"{type(tokenizer).__name__} has none; set data.template = \"chatml\"")
    return from_folder(Path(file).parent)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: a chat template must be UTF-8 text ({exc.reason} at byte "
                        f"{exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read the chat template ({exc.strerror})") from None


def tokenizer_specials(tokenizer: Any) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` / ``pad_token`` as a template sees them (transformers
    passes the tokenizer's special tokens' texts): a Hugging Face folder's configured ones,
    else the text of the tokenizer's BOS / EOS id where it has one."""
    file = getattr(tokenizer, "file", None)
    found = ({f"{k}_token": v for k, v in configured_specials(Path(file).parent).items()}
             if file is not None else {})
    to_text = getattr(tokenizer, "id_to_token", None)
    for key in ("bos", "eos"):
        token_id = getattr(tokenizer, f"{key}_id", None)
        text = to_text(token_id) if to_text is not None and token_id is not None else None
        if f"{key}_token" not in found and text:
            found[f"{key}_token"] = text
    return found


def _checked(template: ChatTemplate, tokenizer: Any) -> ChatTemplate:
    """A template that writes a special token the tokenizer has no text for is refused: it
    would render as nothing (``{{ bos_token }}``) or fail on the first row."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:  # (the generation tags are kiln's extension: left out to list the names)
        used = meta.find_undeclared_variables(env.parse(_GENERATION_TAGS.sub("", template.source)))
    except jinja2.TemplateSyntaxError:
        return template  # the compile names the fault, with its line
    missing = sorted(n for n in used if n in SPECIAL_NAMES and n not in template.specials)
    if missing:
        raise DataError(
            f"chat template {template.name} writes {', '.join(missing)}, which the "
            f"{type(tokenizer).__name__} has no text for; use a Hugging Face tokenizer whose "
            "tokenizer_config.json names it, or a template without it")
    return template


def end_of_turn(template: ChatTemplate) -> str:
    """The text the template writes after an assistant message's content (``<|im_end|>``,
    ``<|eot_id|>``, ``</s>``): where a generated answer stops."""
    mark = "\x00kiln-answer\x00"
    text, _ = template.render([{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": mark}])
    return text[text.rindex(mark) + len(mark):].strip()


def prompt_ids(template: ChatTemplate, tokenizer: Any, messages: list[dict[str, str]]
               ) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt, ready to sample the
    assistant's answer (BOS first for a named template, as the chat data writes it)."""
    text, _ = template.render(messages, add_generation_prompt=True)
    ids = list(tokenizer.encode(text, bos=False, eos=False))
    return [tokenizer.bos_id, *ids] if template.adds_bos else ids
