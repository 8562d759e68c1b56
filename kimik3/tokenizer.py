"""Tokenizers behind one interface. `ByteTokenizer` serves the tiny presets (no download): ids
0-255 are bytes, then the config's bos / eos / pad ids. `KimiTokenizer` reads a checkpoint
directory's tiktoken BPE (`tiktoken.model`) and `tokenizer_config.json` (special tokens, chat
template)."""
from __future__ import annotations

import abc
import json
import os

# Kimi's pre-tokenizer split (tokenization_kimi.py's pat_str): Han runs are their own pieces.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256  # ids after the BPE ranks; unnamed ones are <|reserved_token_i|>


class Tokenizer(abc.ABC):
    """What generation, the engine and the batch script need from a tokenizer."""
    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    @abc.abstractmethod
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text -> token ids (with the BOS id first when add_bos)."""

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """Token ids -> text."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        raise ValueError(f"{type(self).__name__} has no chat template; pass token ids or plain text")


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


class KimiTokenizer(Tokenizer):
    """tiktoken BPE + specials + chat template from a checkpoint directory."""

    def __init__(self, directory: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        model_file = os.path.join(directory, "tiktoken.model")
        config_file = os.path.join(directory, "tokenizer_config.json")
        for f in (model_file, config_file):
            if not os.path.exists(f):
                raise FileNotFoundError(f"{f} is missing: a Kimi tokenizer needs tiktoken.model and tokenizer_config.json")
        try:
            ranks = load_tiktoken_bpe(model_file)
        except Exception as e:  # tiktoken raises bare ValueErrors on malformed lines
            raise ValueError(f"{model_file}: not a tiktoken BPE file ({e})") from None
        with open(config_file) as f:
            config = json.load(f)
        n = len(ranks)
        named = {int(i): tok["content"] for i, tok in (config.get("added_tokens_decoder") or {}).items()}
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED_SPECIAL)}
        specials.update({content: i for i, content in named.items()})
        self._enc = tiktoken.Encoding(name=os.path.basename(os.path.abspath(directory)), pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.vocab_size = n + NUM_RESERVED_SPECIAL
        self.special_ids = specials

        def special(key):
            tok = config.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return specials.get(tok) if tok is not None else None

        self.bos_id, self.eos_id = special("bos_token"), special("eos_token")
        self.chat_template = config.get("chat_template")
        jinja = os.path.join(directory, "chat_template.jinja")
        if self.chat_template is None and os.path.exists(jinja):
            with open(jinja) as f:
                self.chat_template = f.read()

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Special-token strings inside user text stay text unless allow_special is set."""
        ids = self._enc.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer_config.json has no chat_template; pass a plain prompt")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        text = env.from_string(self.chat_template).render(messages=messages,
                                                          add_generation_prompt=add_generation_prompt)
        return self.encode(text, allow_special=True)


class IncrementalDecoder:
    """The text of a growing token list, decoding per push only the tokens since the text last
    ended on a whole character (plus the push before, as the decoder's context): linear, not
    quadratic, in the length. `push` returns the whole text so far; a trailing partial UTF-8
    character shows as U+FFFD until its last byte arrives. `settled`: the text that no later
    push changes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.settled = ""  # the text of tokens[:read], whole characters
        self.prefix = self.read = 0  # the window decoded again starts one push back

    def push(self, tokens) -> str:
        self.tokens += tokens
        before = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        pending = self.tokenizer.decode(self.tokens[self.prefix:])[len(before):]
        text = self.settled + pending
        if not pending.endswith("\ufffd"):  # whole characters: settle them, move the window on
            self.settled, self.prefix, self.read = text, self.read, len(self.tokens)
        return text


def load_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer a checkpoint directory ships."""
    return KimiTokenizer(directory)


def default_tokenizer(cfg) -> Tokenizer:
    """The tokenizer a config implies without files: bytes for small-vocab (tiny) models."""
    if cfg.vocab_size <= 1024:
        return ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    raise ValueError(f"model {cfg.name!r} has a {cfg.vocab_size}-token vocabulary: pass its tokenizer "
                     "(a checkpoint directory's tokenizer files), or pass token ids instead of text")
