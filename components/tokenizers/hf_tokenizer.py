"""The ``huggingface`` tokenizer: a ``tokenizer.json`` read by the ``tokenizers`` library.

``path`` is a ``tokenizer.json`` file, a folder holding one, or ``hf://owner/repo[@revision]``
(fetched with ``huggingface_hub`` into the Hub cache; offline, ``HF_HUB_OFFLINE=1``, only the
cache is read). BOS / EOS / pad come from the recipe (``bos_token`` ...), else the
``tokenizer_config.json`` / ``special_tokens_map.json`` beside the file, else well-known special
token names; a tokenizer with one document separator (GPT-2's ``<|endoftext|>``) uses it for both.

kiln adds BOS and EOS itself (``encode_array`` / ``encode_batch`` give bare ids, the tokenizer's
own post-processor is not run), so every tokenizer packs documents the same way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.errors import RecipeError
from kiln.components.registry import register
from kiln.components.sources.source_files import hub_offline

HUB_PREFIX = "hf://"
TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Names tried, in order, when neither the recipe nor the tokenizer's config names a token.
_KNOWN = {
    "bos": ("<|begin_of_text|>", "<|bos|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>"),
    "eos": ("<|end_of_text|>", "<|eos|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>"),
    "pad": ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>"),
}


class HuggingFaceTokenizerConfig(ComponentConfig):
    """A tokenizer.json (local file or folder, or a Hub repo) and its special tokens."""

    path: str = Field("", description='tokenizer.json, a folder holding one, or '
                      '"hf://owner/repo[@revision]" (read from the Hub cache when offline)')
    bos_token: str = Field("", description='BOS token text ("" = from the tokenizer\'s config)')
    eos_token: str = Field("", description='EOS token text ("" = from the tokenizer\'s config)')
    pad_token: str = Field("", description='pad token text ("" = from the config, else none)')
    add_bos: bool = Field(True, description="encode() starts a text with BOS")
    add_eos: bool = Field(False, description="encode() ends a text with EOS")
    cache_dir: str = Field("", description='Hub cache folder for hf:// paths ("" = HF default)')


def parse_hub_path(path: str) -> tuple[str, str | None]:
    """``hf://owner/repo[@revision]`` -> (repo id, revision or None)."""
    spec = path[len(HUB_PREFIX):]
    repo, _, revision = spec.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise RecipeError(f"tokenizer.path = {path!r}: write hf://owner/repo or "
                          "hf://owner/repo@revision")
    return repo, revision or None


def fetch_from_hub(path: str, cache_dir: str = "", filename: str = TOKENIZER_FILE) -> Path:
    """The cached folder holding the repo's ``filename`` (and its config files if any)."""
    from huggingface_hub import hf_hub_download

    repo, revision = parse_hub_path(path)
    try:
        file = hf_hub_download(repo, filename, revision=revision, cache_dir=cache_dir or None)
    except Exception as exc:  # the Hub library raises several types for "not there"
        where = "not in the local Hub cache and HF_HUB_OFFLINE is set" if hub_offline() else \
            "could not be downloaded"
        raise RecipeError(
            f"tokenizer.path = {path!r}: {filename} of {repo} {where} "
            f"({type(exc).__name__}); download it once online (`hf download {repo} "
            f"{filename}`) or point tokenizer.path at a local {filename}"
        ) from None
    for name in _CONFIG_FILES:  # optional: absent from many repos
        try:
            hf_hub_download(repo, name, revision=revision, cache_dir=cache_dir or None)
        except Exception:  # noqa: S112 - an absent optional file is the common case
            continue
    return Path(file).parent


def resolve_file(path: str, cache_dir: str = "", filename: str = TOKENIZER_FILE) -> Path:
    """The ``filename`` that ``path`` names: the file, the one in a folder, or the Hub repo's
    (downloaded into the Hub cache)."""
    if not path:
        raise RecipeError(f"tokenizer.path is empty: give a {filename}, a folder holding one "
                          'or "hf://owner/repo" (or train one: kiln tokenizer train)')
    if path.startswith(HUB_PREFIX):
        return fetch_from_hub(path, cache_dir, filename) / filename
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / filename
    if not file.is_file():
        raise RecipeError(f"tokenizer.path = {path!r}: {file} does not exist; give a "
                          f"{filename} or a folder holding one")
    return file


def file_fingerprint(kind: str, data: bytes, vocab: int, bos: int, eos: int) -> str:
    """Identifies an id mapping read from a file: its hash, the vocabulary and the specials."""
    digest = hashlib.sha256(data).hexdigest()[:16]
    return f"{kind}-v1:sha256={digest}:vocab={vocab}:bos={bos}:eos={eos}"


class TokenizerBase:
    """``encode`` / ``encode_array`` / ``encode_batch`` from a subclass's ``bare_ids``."""

    bos_id: int
    eos_id: int
    add_bos: bool = True
    add_eos: bool = False

    def bare_ids(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str, *, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        """Token ids of ``text``; ``bos``/``eos`` override the config's add_bos/add_eos."""
        ids = list(self.bare_ids(text))
        if self.add_bos if bos is None else bos:
            ids.insert(0, self.bos_id)
        if self.add_eos if eos is None else eos:
            ids.append(self.eos_id)
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """The bare ids of ``text`` (no specials) as uint32."""
        return np.asarray(self.bare_ids(text), dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Bare ids of each text (uint32)."""
        return [self.encode_array(t) for t in texts]


def _token_text(value: Any) -> str:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def configured_specials(folder: Path) -> dict[str, str]:
    """bos/eos/pad token texts named by the config files beside a tokenizer.json."""
    found: dict[str, str] = {}
    for name in _CONFIG_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RecipeError(f"{file}: unreadable tokenizer config ({exc}); fix or remove "
                              "it") from None
        for key in ("bos", "eos", "pad"):
            text = _token_text(data.get(f"{key}_token")) if isinstance(data, dict) else ""
            if text and key not in found:
                found[key] = text
    return found


class TokenizerFile(TokenizerBase):
    """A loaded ``tokenizers.Tokenizer`` with kiln's protocol; shared by the tokenizer
    components that end in a tokenizer.json (``huggingface``, ``bpe``)."""

    def __init__(self, file: Path, *, source: str, overrides: dict[str, str],
                 add_bos: bool = True, add_eos: bool = False) -> None:
        from tokenizers import Tokenizer

        data = file.read_bytes()
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the Rust library raises plain Exception subclasses
            raise RecipeError(f"{file}: not a tokenizer.json the tokenizers library can read "
                              f"({exc}); check tokenizer.path") from None
        self.file, self.source = file, source
        self.add_bos, self.add_eos = add_bos, add_eos
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        specials = {**configured_specials(file.parent), **{k: v for k, v in overrides.items() if v}}
        ids = {k: self._special_id(k, specials.get(k, ""), vocab, k in overrides and
                                   bool(overrides[k])) for k in ("bos", "eos", "pad")}
        bos, eos = ids["bos"], ids["eos"]
        if bos is None and eos is None:
            raise RecipeError(
                f"{file}: no BOS or EOS token found (no tokenizer_config.json naming them, none "
                f"of {', '.join(_KNOWN['eos'])}); set tokenizer.bos_token and tokenizer.eos_token"
            )
        self.bos_id: int = bos if bos is not None else eos  # type: ignore[assignment]
        self.eos_id: int = eos if eos is not None else bos  # type: ignore[assignment]
        self.pad_id: int | None = ids["pad"]
        self._fingerprint = file_fingerprint("tokenizers", data, self.vocab_size, self.bos_id,
                                             self.eos_id)

    def _special_id(self, key: str, text: str, vocab: dict[str, int], explicit: bool) -> int | None:
        if text:
            if text in vocab:
                return vocab[text]
            where = f"tokenizer.{key}_token" if explicit else f"{self.file.parent}'s config"
            raise RecipeError(f"{where} = {text!r} is not a token of {self.file}; use one of its "
                              "special tokens")
        return next((vocab[t] for t in _KNOWN[key] if t in vocab), None)

    def __getstate__(self) -> dict[str, Any]:  # workers get the tokenizer as JSON text
        return {**self.__dict__, "_tok": self._tok.to_str()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.__dict__.update({**state, "_tok": Tokenizer.from_str(state["_tok"])})

    def bare_ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Bare ids of ``text`` and each token's character span (chat masks)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Bare ids of each text (uint32), encoded as one batch (the data builder's path)."""
        out = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in out]

    def decode(self, ids: list[int] | np.ndarray, *, skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special=False``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def fingerprint(self) -> str:
        """Identifies the id mapping: the file's hash, the vocabulary and the specials."""
        return self._fingerprint

    def save_files(self, folder: Path) -> list[str]:
        """Write this tokenizer into an export folder the way ``transformers`` reads it:
        ``tokenizer.json`` (the same bytes) and ``tokenizer_config.json`` (the source's, if any,
        with kiln's BOS / EOS / pad tokens, which may come from the recipe); a
        ``special_tokens_map.json`` beside the source is copied with the same tokens. Returns
        the file names written."""
        folder = Path(folder)
        (folder / TOKENIZER_FILE).write_bytes(self.file.read_bytes())
        specials = {f"{k}_token": self.id_to_token(i) for k, i in
                    (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id))
                    if i is not None}
        written = [TOKENIZER_FILE]
        for name in _CONFIG_FILES:
            source = self.file.parent / name
            if name == "tokenizer_config.json" or source.is_file():
                data = json.loads(source.read_text(encoding="utf-8")) if source.is_file() else {
                    "tokenizer_class": "PreTrainedTokenizerFast"}
                data.update(specials)
                (folder / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
                written.append(name)
        return written


@register("tokenizer", "huggingface")
class HuggingFaceTokenizer(TokenizerFile):
    """A Hugging Face tokenizer.json: local file or folder, or hf://owner/repo[@revision]."""

    Config = HuggingFaceTokenizerConfig

    def __init__(self, cfg: HuggingFaceTokenizerConfig, **context: object) -> None:
        self.cfg = cfg
        file = resolve_file(cfg.path, cfg.cache_dir)
        super().__init__(file, source=cfg.path, add_bos=cfg.add_bos, add_eos=cfg.add_eos,
                         overrides={"bos": cfg.bos_token, "eos": cfg.eos_token,
                                    "pad": cfg.pad_token})
