"""The Kimi tokenizer from a checkpoint directory (tiktoken BPE + tokenizer_config.json), and
stop strings found in the decoded output."""
import base64
import json

import numpy as np
import pytest

import kimik3
from kimik3.tokenizer import ByteTokenizer

# A tiny BPE: the 256 bytes, then merges that build "hello" and the Han pair "你好".
MERGES = [b"he", b"ll", b"llo", b"hello", "你".encode(), "你好".encode()]
BOS, EOS = "[BOS]", "<|im_end|>"
TEMPLATE = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
            "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def _write_tokenizer(d, merges=MERGES, template=TEMPLATE):
    ranks = [bytes([i]) for i in range(256)]
    for m in merges:  # every prefix gets a rank, so BPE can build the merge left to right
        ranks += [m[:k] for k in range(2, len(m) + 1) if m[:k] not in ranks]
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    n = len(ranks)
    names = {n: BOS, n + 1: "[EOS]", n + 2: EOS, n + 3: "<|im_user|>", n + 4: "<|im_assistant|>",
             n + 5: "<|im_system|>", n + 6: "<|im_middle|>"}
    cfg = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in names.items()},
           "bos_token": BOS, "eos_token": {"content": EOS}, "chat_template": template}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return n, {c: i for i, c in names.items()}


def test_encode_decode_and_specials(tmp_path):
    n, ids = _write_tokenizer(tmp_path)
    tok = kimik3.load_tokenizer(str(tmp_path))
    assert tok.vocab_size == n + 256 and tok.bos_id == ids[BOS] and tok.eos_id == ids[EOS]
    hello = tok.encode("hello")
    assert len(hello) == 1 and tok.decode(hello) == "hello"
    text = "hello 你好, world! 123"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("你好hello")[0] == tok.encode("你好")[0]  # Han runs split from letters
    # special strings in user text stay text unless allowed
    assert ids[EOS] not in tok.encode("a<|im_end|>b")
    assert ids[EOS] in tok.encode("a<|im_end|>b", allow_special=True)
    assert tok.encode("hi", add_bos=True)[0] == ids[BOS]
    assert tok.decode([n + 100]) == f"<|reserved_token_{n + 100}|>"  # unnamed reserved ids


def test_chat_template(tmp_path):
    _, ids = _write_tokenizer(tmp_path)
    tok = kimik3.load_tokenizer(str(tmp_path))
    out = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert out[0] == ids["<|im_system|>"] and out[-1] == ids["<|im_middle|>"]
    assert out.count(ids[EOS]) == 2 and tok.decode(out).endswith("<|im_assistant|>assistant<|im_middle|>")


def test_missing_files_and_template(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiktoken.model is missing"):
        kimik3.load_tokenizer(str(tmp_path))
    _write_tokenizer(tmp_path, template=None)
    with pytest.raises(ValueError, match="no chat_template"):
        kimik3.load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def test_byte_tokenizer_round_trip():
    tok = kimik3.default_tokenizer(kimik3.Config.preset("tiny"))
    assert tok.decode(tok.encode("héllo", add_bos=True)) == "héllo"


def test_stop_strings_are_found_incrementally_where_the_whole_text_has_them():
    """accept_token decodes a window per token; it stops at the first token whose whole decoded
    output contains a stop string, and cuts the text there, as decoding everything would."""
    from kimik3.generation import Completion, accept_token

    rng = np.random.default_rng(0)
    tok = ByteTokenizer(320)
    pieces = [b"a", b"E", b"N", b"D", b"!", "\u00e9".encode(), "\u6f22".encode(), "\U0001f642".encode()]
    stops = ("END", "\u00e9!", "\u6f22a")
    for _ in range(200):
        ids = [b for _ in range(rng.integers(1, 30)) for b in pieces[rng.integers(len(pieces))]]
        out, reason = Completion(), None
        for t in ids:
            reason = accept_token(out, t, 10 ** 6, set(), stops, tok)
            if reason:
                break
        want = next((k for k in range(1, len(ids) + 1) if any(s in tok.decode(ids[:k]) for s in stops)), None)
        if want is None:
            assert reason is None and len(out) == len(ids)
        else:
            text = tok.decode(ids[:want])
            assert (reason, len(out)) == ("stop", want)
            assert out.text == text[:min(text.index(s) for s in stops if s in text)]
