"""The ``tiktoken`` tokenizer: a local ``.tiktoken`` ranks file (one ``base64(token) rank`` a
line: OpenAI's encodings, Llama 3's original ``tokenizer.model``) plus a named split pattern,
read by the ``tiktoken`` package (the ``tiktoken`` extra). Nothing is downloaded.

Special tokens follow the ranks: ``special_tokens`` in order, then reserved ones up to
``num_special`` (Llama 3: 256, ``<|reserved_special_token_N|>``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.errors import RecipeError
from kiln.components.registry import register
from kiln.components.tokenizers.hf_tokenizer import TokenizerBase, file_fingerprint, resolve_file

PATTERNS = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
              r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
}
PATTERNS["llama3"] = PATTERNS["cl100k"]


class TiktokenConfig(ComponentConfig):
    """A .tiktoken ranks file, a split pattern and the special tokens after the ranks."""

    path: str = Field("", description=".tiktoken ranks file (or a folder holding "
                      "tokenizer.model in that format, or hf://owner/repo)")
    pattern: str = Field("llama3", description="split regex: gpt2, cl100k, llama3 or a regex")
    special_tokens: list[str] = Field(
        default_factory=lambda: ["<|begin_of_text|>", "<|end_of_text|>"],
        description="special tokens, ids from the number of ranks on")
    num_special: int = Field(0, ge=0, description="pad the specials with "
                             "<|reserved_special_token_N|> up to this many (Llama 3: 256)")
    bos_token: str = Field("<|begin_of_text|>", description="BOS: one of the special tokens")
    eos_token: str = Field("<|end_of_text|>", description="EOS: one of the special tokens")
    pad_token: str = Field("", description='pad: one of the special tokens ("" = none)')
    add_bos: bool = Field(True, description="encode() starts a text with BOS")
    add_eos: bool = Field(False, description="encode() ends a text with EOS")
    cache_dir: str = Field("", description='Hub cache folder for hf:// paths ("" = HF default)')


def _ranks(data: bytes, where: str) -> dict[bytes, int]:
    ranks = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise RecipeError(f"{where}:{lineno}: not a tiktoken ranks line "
                              "(base64 token, space, rank)") from None
    return ranks


@register("tokenizer", "tiktoken")
class TiktokenTokenizer(TokenizerBase):
    """A .tiktoken ranks file plus a named pattern (needs tiktoken: the tiktoken extra)."""

    Config = TiktokenConfig

    def __init__(self, cfg: TiktokenConfig, **context: object) -> None:
        self.cfg, self.source = cfg, cfg.path
        self.add_bos, self.add_eos = cfg.add_bos, cfg.add_eos
        file = resolve_file(cfg.path, cfg.cache_dir, "tokenizer.model")
        data = file.read_bytes()
        ranks = _ranks(data, str(file))
        n = len(ranks)
        names = list(cfg.special_tokens) + [f"<|reserved_special_token_{i}|>" for i in
                                            range(max(cfg.num_special - len(cfg.special_tokens),
                                                      0))]
        self._specials = {name: n + i for i, name in enumerate(names)}
        for key in ("bos", "eos", "pad"):
            name = getattr(cfg, f"{key}_token")
            if name and name not in self._specials:
                raise RecipeError(f"tokenizer.{key}_token = {name!r} is not among "
                                  f"tokenizer.special_tokens {cfg.special_tokens}")
        self.bos_id = self._specials[cfg.bos_token]
        self.eos_id = self._specials[cfg.eos_token]
        self.pad_id = self._specials[cfg.pad_token] if cfg.pad_token else None
        self.vocab_size = n + len(names)
        self._args = (str(file), PATTERNS.get(cfg.pattern, cfg.pattern), ranks)
        self._enc = self._encoding()
        self._fingerprint = file_fingerprint(
            "tiktoken", data + self._args[1].encode() + repr(self._specials).encode(),
            self.vocab_size, self.bos_id, self.eos_id)

    def _encoding(self) -> Any:
        try:
            import tiktoken
        except ImportError:
            raise RecipeError("tokenizer.type = \"tiktoken\" needs the tiktoken package: pip "
                              "install 'kiln[tiktoken]'") from None
        name, pattern, ranks = self._args
        return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens=self._specials)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_enc": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._enc = self._encoding()

    def bare_ids(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Bare ids of each text (uint32), one call for the batch."""
        return [np.asarray(ids, dtype=np.uint32)
                for ids in self._enc.encode_ordinary_batch(list(texts), num_threads=1)]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens are dropped."""
        specials = set(self._specials.values())
        return self._enc.decode([int(i) for i in ids if int(i) not in specials])

    def fingerprint(self) -> str:
        return self._fingerprint
