"""Tokenizers behind one interface. `ByteTokenizer` serves the tiny presets (no download): ids
0-255 are bytes, then the config's bos / eos / pad ids."""
from __future__ import annotations


class Tokenizer:
    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    def __init__(self, vocab_size: int, bos_id: int | None = 256, eos_id: int | None = 257):
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, bos_id, eos_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        # Non-byte ids (specials, or ids a random model invents) are dropped from the text.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def default_tokenizer(cfg) -> Tokenizer:
    """The tokenizer a config implies without files: bytes for small-vocab (tiny) models."""
    if cfg.vocab_size <= 1024:
        return ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    raise ValueError(f"model {cfg.name!r} has a {cfg.vocab_size}-token vocabulary: pass its tokenizer "
                     "(a checkpoint directory's tokenizer files), or pass token ids instead of text")
