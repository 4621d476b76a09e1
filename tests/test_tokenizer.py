"""Tokenizer: pre-tokenizer splits, BPE training, encoding round trips, chat layout, GGUF load."""
from pathlib import Path

import numpy as np
import pytest

from pocketfm.errors import InputError
from pocketfm.tokenizer import (ASSISTANT_TEXT, BOS_TEXT, DEFAULT_SPECIALS, END_THINK_TEXT,
                                EOS_TEXT, THINK_TEXT, USER_TEXT, Tokenizer, build_byte_bpe_vocab,
                                bytes_to_unicode, pretokenize)

FIXTURE = Path(__file__).parent / "fixtures" / "official-tiny" / "model.gguf"

CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.\n"
    "def forward(tokens, positions, state):\n    return model(tokens, positions, state)\n"
    "深度求索的模型使用混合注意力。注意力机制很重要。"
    "Numbers like 12345 and 3.14159 appear in the text, as do emoji 🙂 and café.\n"
    "A reader follows one token from the file bytes to the sampled id: configuration, weights,\n"
    "tokenizer, model forward, memory, generation. Every buffer carries a shape comment and\n"
    "every kernel is tested against its reference on fresh random inputs before it is trusted.\n"
    "Compressed attention keeps a sliding window of recent tokens and selects older entries.\n"
) * 20

SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nnewlines\n\n\nend",
    "中文文本测试内容, 日本語のテキスト, カタカナ",
    "emoji 🙂🎉👩‍👩‍👧 and flags 🇫🇷",
    "combining e\u0301 a\u0308 \u0915\u094d\u0937 and zero-width\u200bspace",
    "numbers 1234567890 3.14 -42",
    "\x00\x01\x7f control bytes \u00ad soft hyphen",
    "code: if (x >= 10) { y = x ** 2; } // done",
]


@pytest.fixture(scope="module")
def vocab():
    return build_byte_bpe_vocab(512, CORPUS, DEFAULT_SPECIALS)


@pytest.fixture(scope="module")
def tok(vocab):
    tokens, merges, types = vocab
    return Tokenizer(tokens, merges, types, bos_id=0, eos_id=1, pre="joyai-llm")


def random_text(rng, n):
    """n random code points from the whole Unicode range minus surrogates, weighted to ASCII."""
    cps = []
    while len(cps) < n:
        cp = int(rng.integers(0, 0x110000)) if rng.random() < 0.6 else int(rng.integers(0, 128))
        if not 0xD800 <= cp <= 0xDFFF:
            cps.append(cp)
    return "".join(map(chr, cps))


# -- pre-tokenizer ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, pieces", [
    ("12345", ["123", "45"]),
    (" hello world", [" hello", " world"]),
    ("Hello world", ["Hello", " world"]),
    ("a  b", ["a", " ", " b"]),                    # \s+(?!\S) leaves one space for the word
    ("trailing  ", ["trailing", "  "]),            # ...but not at the end of the text
    ("abc日本語def", ["abc", "日本語", "def"]),      # CJK runs split although they are \p{L}
    ("中文abc", ["中文", "abc"]),
    ("x\n\ny", ["x", "\n\n", "y"]),
    ("end.\n\nNext", ["end", ".\n\n", "Next"]),    # punctuation keeps its newlines
    (" {\n", [" {\n"]),
    ("(hello", ["(hello"]),                        # [P/S][A-Za-z]+
    ("((hello", ["((", "hello"]),
    ("don't", ["don", "'t"]),
    ("3.14", ["3", ".", "14"]),
    ("  \n  \n  x", ["  \n  \n", " ", " x"]),      # \s*[\r\n]+ stops at the last newline
    ("e\u0301te\u0301", ["e\u0301te\u0301"]),      # marks stay in the word
    ("\tword", ["\tword"]),
])
def test_joyai_splits(text, pieces):
    assert pretokenize(text, "joyai-llm") == pieces


def test_gpt2_default_splits():
    assert pretokenize("Hello world's 123 !!", "default") == \
        ["Hello", " world", "'s", " 123", " !!"]
    assert pretokenize("x\n\ny", "default") == ["x", "\n", "\n", "y"]


@pytest.mark.parametrize("pre", ["joyai-llm", "deepseek-v3", "default"])
def test_pieces_concatenate_to_input(pre):
    rng = np.random.default_rng(0)
    for text in SAMPLES + [random_text(rng, 200) for _ in range(30)]:
        pieces = pretokenize(text, pre)
        assert "".join(pieces) == text
        assert all(pieces)


# The regexes as DeepSeek's tokenizer.json and GPT-2 write them, for an oracle check through the
# `regex` package where it happens to be installed (pocketfm itself does not use it).
JOYAI_REGEXES = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
GPT2_REGEXES = [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"]


def _regex_split(regex, text, patterns):
    """HF Split(behavior="Isolated") for each pattern in turn: matches and gaps both kept."""
    pieces = [text] if text else []
    for pattern in patterns:
        out = []
        for s in pieces:
            at = 0
            for m in regex.finditer(pattern, s):
                if m.end() > m.start():
                    out += [s[at:m.start()], m.group()] if m.start() > at else [m.group()]
                    at = m.end()
            out += [s[at:]] if at < len(s) else []
        pieces = out
    return pieces


@pytest.mark.parametrize("pre, patterns", [("joyai-llm", JOYAI_REGEXES), ("default", GPT2_REGEXES)])
def test_pretokenize_matches_a_regex_engine(pre, patterns):
    regex = pytest.importorskip("regex")
    # Characters whose category is the same in every Unicode version: the `regex` package may
    # be newer than unicodedata, and a code point unassigned in one splits differently.
    alphabet = list(" \t\n\r\x0b\x00\x85\xa0\u2003\u3000aZé\u0301中日あア한Ж1²٣½.,!?'\"(){}[]~+$€🙂"
                    "\u200b\u200d-_/\\@#")
    rng = np.random.default_rng(2)
    for _ in range(2000):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 12))))
        assert pretokenize(text, pre) == _regex_split(regex, text, patterns), repr(text)


def test_unknown_pre_is_rejected():
    with pytest.raises(InputError, match="tokenizer.ggml.pre"):
        pretokenize("x", "llama-bpe")


# -- vocabulary building ----------------------------------------------------------------------

def test_vocab_layout(vocab):
    tokens, merges, types = vocab
    assert len(tokens) == len(types) == 512
    assert tokens[:6] == DEFAULT_SPECIALS and types[:6] == [3] * 6
    byte_chars = bytes_to_unicode()
    assert tokens[6:262] == [byte_chars[b] for b in range(256)]
    assert len(merges) == 512 - 262 and all(t == 1 for t in types[6:])
    for merge, token in zip(merges, tokens[262:]):
        left, right = merge.split(" ")
        assert left + right == token


def test_vocab_is_deterministic(vocab):
    assert build_byte_bpe_vocab(512, CORPUS, DEFAULT_SPECIALS) == vocab


def test_vocab_pads_when_corpus_is_exhausted():
    tokens, merges, types = build_byte_bpe_vocab(300, "ab ab", DEFAULT_SPECIALS)
    assert len(tokens) == 300 and merges == ["a b", "Ġ ab"]
    assert types[-1] == 5 and tokens[-1].startswith("<unused")


def test_bytes_to_unicode_is_a_bijection():
    mapping = bytes_to_unicode()
    assert len(set(mapping.values())) == 256
    assert mapping[ord(" ")] == "Ġ" and mapping[ord("A")] == "A" and mapping[10] == "Ċ"


# -- encode / decode --------------------------------------------------------------------------

def test_round_trip_samples(tok):
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


def test_round_trip_random_unicode(tok):
    rng = np.random.default_rng(1)
    for _ in range(40):
        text = random_text(rng, int(rng.integers(1, 120)))
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_merges_are_used(tok):
    for word in ("The", " the", " fox", " dog", "注意力"):
        assert len(tok.encode(word)) < len(word.encode("utf-8"))
    assert len(tok.encode(" the")) == 1


def test_specials_map_to_their_ids(tok):
    text = f"{BOS_TEXT}hi{USER_TEXT}question{ASSISTANT_TEXT}{THINK_TEXT}x{END_THINK_TEXT}"
    ids = tok.encode(text)
    assert ids[0] == 0 and ids[-1] == 5
    assert [i for i in ids if i < 6] == [0, 2, 3, 4, 5]
    assert tok.decode(ids) == text
    assert tok.encode("a", bos=True)[0] == tok.bos_id


def test_chat_layout(tok):
    user_id, assistant_id, think_id, end_think_id = (
        DEFAULT_SPECIALS.index(t) for t in (USER_TEXT, ASSISTANT_TEXT, THINK_TEXT, END_THINK_TEXT))
    ids = tok.chat("What is 2+2?", system="Be brief.")
    u, a = ids.index(user_id), ids.index(assistant_id)
    assert ids[0] == tok.bos_id and 1 < u < a == len(ids) - 2 and ids[-1] == end_think_id
    assert ids[1:u] == tok.encode("Be brief.") and ids[u + 1:a] == tok.encode("What is 2+2?")
    assert tok.decode(ids) == f"{BOS_TEXT}Be brief.{USER_TEXT}What is 2+2?{ASSISTANT_TEXT}</think>"
    thinking = tok.chat("hi", thinking=True)
    assert thinking == [tok.bos_id, user_id, *tok.encode("hi"), assistant_id, think_id]


def test_decode_stream_holds_back_partial_utf8(tok):
    text = "naïve 🙂 深度求索 done"
    stream = tok.decode_stream()
    ids = tok.encode(text)
    parts = [stream.push(i) for i in ids]
    assert "".join(parts) + stream.flush() == text
    # byte-level ids of "🙂" alone: nothing comes out until its fourth byte arrives
    byte_ids = [6 + b for b in "🙂".encode("utf-8")]
    stream = tok.decode_stream()
    assert [stream.push(i) for i in byte_ids] == ["", "", "", "🙂"]


def test_decode_replaces_invalid_utf8(tok):
    assert tok.decode([6 + 0xFF, 6 + ord("a")]) == "\ufffda"
    with pytest.raises(InputError):
        tok.decode([tok.vocab_size])


def test_missing_byte_token_raises():
    tokens = [BOS_TEXT, EOS_TEXT] + [bytes_to_unicode()[b] for b in range(128)]  # ASCII only
    small = Tokenizer(tokens, [], None, bos_id=0, eos_id=1)
    assert small.decode(small.encode("ok")) == "ok"
    with pytest.raises(InputError, match="byte 0xC3"):
        small.encode("é")
    with pytest.raises(InputError, match=USER_TEXT):
        small.chat("hi")


# -- metadata ---------------------------------------------------------------------------------

def _meta(vocab, **changes):
    tokens, merges, types = vocab
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "joyai-llm",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1}
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def test_from_metadata(vocab, tok):
    loaded = Tokenizer.from_metadata(_meta(vocab))
    assert loaded.vocab_size == 512 and (loaded.bos_id, loaded.eos_id) == (0, 1)
    assert loaded.encode(SAMPLES[4]) == tok.encode(SAMPLES[4])


@pytest.mark.parametrize("changes, key", [
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.bos_token_id": 512}, "tokenizer.ggml.bos_token_id"),
    ({"tokenizer.ggml.eos_token_id": -1}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.ggml.token_type": [1, 3]}, "tokenizer.ggml.token_type"),
    ({"tokenizer.ggml.merges": ["nospace"]}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.pre": "mystery"}, "tokenizer.ggml.pre"),
])
def test_from_metadata_errors_name_the_key(vocab, changes, key):
    with pytest.raises(InputError, match=key.replace(".", r"\.")) as err:
        Tokenizer.from_metadata(_meta(vocab, **changes))
    assert "\n" not in str(err.value)


def test_fixture_tokenizer_loads():
    gguf = pytest.importorskip("gguf")
    if not FIXTURE.exists():
        pytest.skip("official-tiny fixture not present")
    reader = gguf.GGUFReader(FIXTURE)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tok = Tokenizer.from_metadata(meta)
    assert tok.vocab_size == 256 and tok.pre == "default"
    # 256 byte tokens in byte order and no merges: token id == byte value
    text = "Héllo 中文 🙂\n"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    fixture_ids = np.load(FIXTURE.parent / "tokens.npy")
    assert isinstance(tok.decode(fixture_ids.tolist()), str)
    with pytest.raises(InputError, match="chat format"):
        tok.chat("hi")
