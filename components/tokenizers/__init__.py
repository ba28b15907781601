"""Tokenizers: bytes, Hugging Face tokenizer.json, byte-level BPE, SentencePiece, tiktoken."""
