"""The ``sentencepiece`` tokenizer: a SentencePiece ``.model`` file (Llama 2, Mistral, Gemma,
T5 ...) read by the ``sentencepiece`` package (the ``sentencepiece`` extra).

``path`` is the ``.model`` file, a folder holding ``tokenizer.model``, or ``hf://owner/repo``
(its ``tokenizer.model``, through the Hub cache). BOS / EOS / pad are the model's own ids
(``bos_id()`` ...); a model without one of BOS / EOS uses the other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.errors import RecipeError
from kiln.components.registry import register
from kiln.components.tokenizers.hf_tokenizer import TokenizerBase, file_fingerprint, resolve_file

MODEL_FILE = "tokenizer.model"


def _processor(data: bytes) -> Any:
    try:
        import sentencepiece as spm
    except ImportError:
        raise RecipeError("tokenizer.type = \"sentencepiece\" needs the sentencepiece package: "
                          "pip install 'kiln[sentencepiece]'") from None
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    return sp


class SentencePieceConfig(ComponentConfig):
    """A SentencePiece .model (local file, folder or Hub repo)."""

    path: str = Field("", description='.model file, a folder holding tokenizer.model, or '
                      '"hf://owner/repo[@revision]"')
    add_bos: bool = Field(True, description="encode() starts a text with BOS")
    add_eos: bool = Field(False, description="encode() ends a text with EOS")
    cache_dir: str = Field("", description='Hub cache folder for hf:// paths ("" = HF default)')


@register("tokenizer", "sentencepiece")
class SentencePieceTokenizer(TokenizerBase):
    """A SentencePiece .model file (needs the sentencepiece package: the sentencepiece extra)."""

    Config = SentencePieceConfig

    def __init__(self, cfg: SentencePieceConfig, **context: object) -> None:
        self.cfg, self.source = cfg, cfg.path
        self.add_bos, self.add_eos = cfg.add_bos, cfg.add_eos
        file = resolve_file(cfg.path, cfg.cache_dir, MODEL_FILE)
        self._data = file.read_bytes()
        try:
            self._sp = _processor(self._data)
        except (RuntimeError, OSError) as exc:
            raise RecipeError(f"{file}: not a SentencePiece model ({exc}); check "
                              "tokenizer.path") from None
        self.vocab_size = self._sp.get_piece_size()
        bos, eos, pad = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        if bos < 0 and eos < 0:
            raise RecipeError(f"{file}: the model defines neither BOS nor EOS; kiln needs one "
                              "to separate documents")
        self.bos_id = bos if bos >= 0 else eos
        self.eos_id = eos if eos >= 0 else bos
        self.pad_id = pad if pad >= 0 else None
        self._fingerprint = file_fingerprint("sentencepiece", self._data, self.vocab_size,
                                             self.bos_id, self.eos_id)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sp": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sp = _processor(self._data)

    def bare_ids(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Bare ids of each text (uint32), one call for the batch."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of ``ids`` (control tokens such as BOS / EOS / pad are dropped)."""
        return self._sp.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return self._fingerprint
