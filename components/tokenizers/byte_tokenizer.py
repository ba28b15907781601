"""The byte tokenizer: UTF-8 bytes as ids, plus BOS and EOS. No files, no network, no training
(an export writes a ``tokenizer.json`` with the same ids for ``transformers``: ``save_files``).

It lets every recipe run anywhere (the default data is Python source, which is mostly ASCII),
and its fingerprint is part of the data cache key so a changed tokenizer never reads stale ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.registry import register

NUM_BYTES = 256
SPECIALS = ("<|bos|>", "<|eos|>")  # ids 256, 257 in an export's tokenizer.json


class ByteTokenizerConfig(ComponentConfig):
    """Settings of the byte tokenizer."""

    add_bos: bool = Field(True, description="encode() starts a text with BOS")
    add_eos: bool = Field(False, description="encode() ends a text with EOS")


@register("tokenizer", "byte")
class ByteTokenizer:
    """UTF-8 bytes as token ids (0-255) plus BOS (256) and EOS (257): vocab_size 258."""

    Config = ByteTokenizerConfig

    bos_id = NUM_BYTES
    eos_id = NUM_BYTES + 1
    vocab_size = NUM_BYTES + 2
    pad_id = None  # no pad token: batches are packed, never padded

    def __init__(self, cfg: ByteTokenizerConfig | None = None, **context: object) -> None:
        self.cfg = cfg if cfg is not None else ByteTokenizerConfig(type="byte")

    def encode(self, text: str, *, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        """Token ids of ``text``; ``bos``/``eos`` override the config's add_bos/add_eos."""
        ids = list(text.encode("utf-8"))
        if self.cfg.add_bos if bos is None else bos:
            ids.insert(0, self.bos_id)
        if self.cfg.add_eos if eos is None else eos:
            ids.append(self.eos_id)
        return ids

    def encode_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        """Bare ids of ``text`` and each byte's character span (chat masks)."""
        data = text.encode("utf-8")
        widths = [len(c.encode("utf-8")) for c in text]
        start = np.repeat(np.arange(len(text)), widths)
        return list(data), np.stack([start, start + 1], axis=1)

    def encode_array(self, text: str) -> np.ndarray:
        """The bare ids of ``text`` (no specials) as uint16: the data builder's fast path."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Bare ids of each text (see ``encode_array``)."""
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of ``ids``; specials are dropped and invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def save_files(self, folder: Path) -> list[str]:
        """An export's tokenizer, the same ids for ``tokenizers`` and ``transformers``: a BPE of
        the 256 byte tokens ``<0x00>``..``<0xFF>`` with byte fallback and no merges (every
        character falls back to its UTF-8 bytes: no ByteLevel remapping), ``<|bos|>`` and
        ``<|eos|>`` as special tokens 256 and 257 added as the config's add_bos / add_eos say.
        transformers reads ``split_special_tokens``, so it encodes those two names in a text as
        bytes, like kiln; the ``tokenizers`` library alone matches them as the special tokens."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, processors

        tok = Tokenizer(models.BPE(vocab={f"<0x{b:02X}>": b for b in range(NUM_BYTES)},
                                   merges=[], byte_fallback=True))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
        tok.decoder = decoders.ByteFallback()
        bos, eos = SPECIALS
        template = [bos] * self.cfg.add_bos + ["$A"] + [eos] * self.cfg.add_eos
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(template), special_tokens=[(bos, self.bos_id), (eos, self.eos_id)])
        folder = Path(folder)
        tok.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                  "eos_token": eos, "split_special_tokens": True}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                      encoding="utf-8")
        return ["tokenizer.json", "tokenizer_config.json"]

    def fingerprint(self) -> str:
        """Identifies the id mapping (not add_bos/add_eos, which the data builder ignores)."""
        return f"byte-v1:vocab={self.vocab_size}:bos={self.bos_id}:eos={self.eos_id}"
