"""Byte-level BPE tokenizer built from GGUF ``tokenizer.ggml.*`` metadata (spec §7.1).

The path of one prompt, in file order:

  text -> split out special tokens ("<｜User｜>" ...) -> pre-tokenize into pieces (``pretokenize``)
       -> each piece's UTF-8 bytes mapped to printable characters (``bytes_to_unicode``)
       -> BPE merges by rank -> token ids.

Decoding runs the other way: token string -> characters -> bytes -> UTF-8. Because every one of
the 256 bytes has its own token, any text encodes; ``decode_stream`` holds back a partial UTF-8
character until the token that completes it arrives.

Also here: ``build_byte_bpe_vocab``, a tiny BPE trainer so that synthetic test models get a real,
deterministic vocabulary with the same special tokens as DeepSeek's.
"""
from __future__ import annotations

import codecs
import re
import string
import unicodedata
from collections import Counter

from pocketfm.errors import InputError

# The special tokens of the DeepSeek-V3/V4 vocab. "｜" is U+FF5C and "▁" is U+2581, not ASCII.
BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
USER_TEXT = "<｜User｜>"
ASSISTANT_TEXT = "<｜Assistant｜>"
THINK_TEXT = "<think>"
END_THINK_TEXT = "</think>"
DEFAULT_SPECIALS = [BOS_TEXT, EOS_TEXT, USER_TEXT, ASSISTANT_TEXT, THINK_TEXT, END_THINK_TEXT]

# tokenizer.ggml.token_type values (llama.cpp / gguf-py TokenType).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

JOYAI_PRES = ("joyai-llm", "deepseek-v3")  # one splitter: llama.cpp gives both the same regexes
GPT2_PRES = ("default", "gpt2")


# ---------------------------------------------------------------------------------------------
# GPT-2 byte <-> character mapping
# ---------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map: 188 printable bytes map to themselves, the other 68
    (controls, space, 0x7F-0xA0, 0xAD) to U+0100.. in byte order, so a token string never holds
    whitespace or control characters and still maps back to bytes one-to-one."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_CHARS = [_BYTE_TO_CHAR[b] for b in range(256)]  # indexable by byte value


# ---------------------------------------------------------------------------------------------
# Character classes of the pre-tokenizer regexes, from unicodedata (no `regex` package)
# ---------------------------------------------------------------------------------------------

# `\s` in the Oniguruma / Rust engines behind HF tokenizers is the Unicode White_Space property.
# str.isspace() differs: it also accepts U+001C..U+001F, so list White_Space explicitly.
_WHITE_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                         + "".join(map(chr, range(0x2000, 0x200B))))
_ASCII_PUNCT = frozenset(string.punctuation)  # the explicit 32-char class of the joyai regex
_ASCII_LETTERS = frozenset(string.ascii_letters)


def _cat(c: str) -> str:
    return unicodedata.category(c)[0]  # major class: L, M, N, P, S, Z, C


def _is_space(c: str) -> bool:
    return c in _WHITE_SPACE


def _is_newline(c: str) -> bool:
    return c == "\r" or c == "\n"


def _is_letter(c: str) -> bool:
    return _cat(c) == "L"


def _is_number(c: str) -> bool:
    return _cat(c) == "N"


def _is_letter_mark(c: str) -> bool:  # [\p{L}\p{M}]
    return _cat(c) in "LM"


def _is_punct_symbol(c: str) -> bool:  # [\p{P}\p{S}]
    return _cat(c) in "PS"


def _is_cjk(c: str) -> bool:
    # [一-龥぀-ゟ゠-ヿ]: CJK ideographs U+4E00..U+9FA5, Hiragana U+3040..309F, Katakana ..U+30FF
    o = ord(c)
    return 0x4E00 <= o <= 0x9FA5 or 0x3040 <= o <= 0x30FF


def _is_gpt2_other(c: str) -> bool:  # [^\s\p{L}\p{N}]
    return not _is_space(c) and _cat(c) not in "LN"


def _run(s: str, i: int, pred) -> int:
    """End of the run of characters satisfying pred that starts at i (i itself if none)."""
    n = len(s)
    while i < n and pred(s[i]):
        i += 1
    return i


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers
# ---------------------------------------------------------------------------------------------
# Each regex is written as a matcher(s, i) -> end of the match starting at i, or None. The
# alternatives are tried in regex order and each one returns what a backtracking engine would,
# so the leftmost alternative that matches at i wins.

def _match_digits(s: str, i: int) -> int | None:  # \p{N}{1,3}
    return min(_run(s, i, _is_number), i + 3) if _is_number(s[i]) else None


def _match_cjk(s: str, i: int) -> int | None:  # [一-龥぀-ゟ゠-ヿ]+
    return _run(s, i, _is_cjk) if _is_cjk(s[i]) else None


def _match_whitespace(s: str, i: int) -> int | None:  # \s+(?!\S) | \s+
    if not _is_space(s[i]):
        return None
    end = _run(s, i, _is_space)
    # \s+(?!\S) backs off one character so the last space stays for the next word (" world"),
    # unless the run reaches the end of the piece or is a single character (then plain \s+).
    return end if end == len(s) or end - i == 1 else end - 1


def _match_joyai_word(s: str, i: int) -> int | None:
    """The third joyai regex: [ASCII punct][A-Za-z]+ | [^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+
    | ' '?[\\p{P}\\p{S}]+[\\r\\n]* | \\s*[\\r\\n]+ | \\s+(?!\\S) | \\s+ ."""
    c, nxt = s[i], s[i + 1] if i + 1 < len(s) else ""
    if c in _ASCII_PUNCT and nxt in _ASCII_LETTERS:  # "(hello", ".com", "'s"
        return _run(s, i + 1, _ASCII_LETTERS.__contains__)
    if _is_letter_mark(c):
        return _run(s, i + 1, _is_letter_mark)
    if nxt and not _is_newline(c) and not _is_punct_symbol(c) and _is_letter_mark(nxt):
        return _run(s, i + 1, _is_letter_mark)  # one leading non-letter, e.g. the space in " world"
    j = i + 1 if c == " " and nxt and _is_punct_symbol(nxt) else i
    if _is_punct_symbol(s[j]):  # punctuation keeps the newlines after it: ".\n\n", " {\n"
        return _run(s, _run(s, j, _is_punct_symbol), _is_newline)
    if _is_space(c):
        end = _run(s, i, _is_space)
        # \s*[\r\n]+ backtracks to the last newline of the run: "  \n  \n  x" -> "  \n  \n"
        last_newline = max(s.rfind("\r", i, end), s.rfind("\n", i, end))
        if last_newline >= 0:
            return last_newline + 1
    return _match_whitespace(s, i)


def _match_gpt2_word(s: str, i: int) -> int | None:
    """GPT-2's regex: 's|'t|'re|'ve|'m|'ll|'d | ' '?\\p{L}+ | ' '?\\p{N}+ | ' '?[^\\s\\p{L}\\p{N}]+
    | \\s+(?!\\S) | \\s+ ."""
    c = s[i]
    if c == "'":
        for suffix in ("s", "t", "re", "ve", "m", "ll", "d"):
            if s.startswith(suffix, i + 1):
                return i + 1 + len(suffix)
    j = i + 1 if c == " " and i + 1 < len(s) else i
    for pred in (_is_letter, _is_number, _is_gpt2_other):
        if pred(s[j]):
            return _run(s, j, pred)
    return _match_whitespace(s, i)


def _isolate(pieces: list[str], matcher) -> list[str]:
    """Split each piece at the matches of one regex, keeping matches and the gaps between them
    (HF `Split(behavior="Isolated")`). Each piece is matched on its own, so `(?!\\S)` sees the
    piece's end as the end of the text."""
    out = []
    for s in pieces:
        i = gap = 0
        while i < len(s):
            end = matcher(s, i)
            if end is None:
                i += 1  # characters no alternative takes (e.g. a lone U+0000) form a gap piece
                continue
            if gap < i:
                out.append(s[gap:i])
            out.append(s[i:end])
            i = gap = end
        if gap < len(s):
            out.append(s[gap:])
    return out


def pretokenize(text: str, pre: str) -> list[str]:
    """Split text into the pieces BPE merges within; "".join(pieces) == text always.

    "joyai-llm" (DeepSeek-V4) and "deepseek-v3": the three regexes of DeepSeek's tokenizer.json
    applied in sequence, each re-splitting the pieces of the previous one: \\p{N}{1,3}, then
    CJK/Hiragana/Katakana runs, then the word regex of ``_match_joyai_word``. Applying them as a
    cascade (not one alternation) is what the HF tokenizer and llama.cpp do: "abc日本" splits
    into "abc", "日本" although the CJK characters are also \\p{L}.
    "default" / "gpt2": GPT-2's single regex (contractions, ' '?letters, ' '?digits,
    ' '?other, whitespace), the usual split for a byte-level BPE without a named pre-tokenizer.
    Categories come from ``unicodedata``, so '~' counts as \\p{S} (llama.cpp's ASCII tables
    leave it out; there " ~~~" splits as " ", "~~~").
    """
    pieces = [text] if text else []
    if pre in JOYAI_PRES:
        for matcher in (_match_digits, _match_cjk, _match_joyai_word):
            pieces = _isolate(pieces, matcher)
        return pieces
    if pre in GPT2_PRES:
        return _isolate(pieces, _match_gpt2_word)
    raise InputError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {pre!r}; "
                     f"expected one of {', '.join(JOYAI_PRES + GPT2_PRES)}")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

class Tokenizer:
    """Byte-level BPE (GPT-2 style byte->unicode mapping) from GGUF tokenizer.ggml.* metadata."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None,
                 bos_id: int, eos_id: int, pre: str = "default",
                 chat_template: str | None = None):
        """Build lookup tables: token text -> id, merge pair -> rank, id -> bytes."""
        self.tokens = [str(t) for t in tokens]
        self.vocab_size = len(self.tokens)
        if self.vocab_size == 0:
            raise InputError("tokenizer.ggml.tokens: empty vocabulary")
        types = [TOKEN_NORMAL] * self.vocab_size if token_types is None else \
            [int(t) for t in token_types]
        if len(types) != self.vocab_size:
            raise InputError(f"tokenizer.ggml.token_type: {len(types)} entries for "
                             f"{self.vocab_size} tokens")
        for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
            if not 0 <= int(value) < self.vocab_size:
                raise InputError(f"tokenizer.ggml.{key}: {value} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        pretokenize("", pre)  # fail now, naming the key, rather than at the first encode
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self.pre, self.chat_template, self.token_types = pre, chat_template, types

        # A later duplicate never shadows the first id a string got (setdefault).
        self._ids: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self._ids.setdefault(t, i)
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate([] if merges is None else merges):
            left, sep, right = str(merge).partition(" ")
            if not sep or not left or not right:
                raise InputError(f"tokenizer.ggml.merges: entry {rank} {merge!r} is not 'a b'")
            self._ranks.setdefault((left, right), rank)

        # Control and user-defined tokens are matched literally in text (as llama.cpp does with
        # parse_special); longest first so no special is cut short by one that is its prefix.
        special = sorted({t for t, ty in zip(self.tokens, types)
                          if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and t}, key=len,
                         reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, special)) + ")") \
            if special else None
        self._byte_ids = [self._ids.get(c) for c in _BYTE_CHARS]  # None: byte has no token
        self._token_bytes = [_token_to_bytes(t, ty) for t, ty in zip(self.tokens, types)]
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF key -> value metadata; a missing or wrong key raises InputError."""
        def need(key):
            if key not in meta:
                raise InputError(f"{key}: missing from the GGUF metadata")
            return meta[key]

        model = need("tokenizer.ggml.model")
        if model != "gpt2":
            raise InputError(f"tokenizer.ggml.model: {model!r} is not supported; "
                             "expected 'gpt2' (byte-level BPE)")
        return cls(tokens=list(need("tokenizer.ggml.tokens")),
                   merges=list(meta.get("tokenizer.ggml.merges", [])),  # 0 merges: bytes only
                   token_types=meta.get("tokenizer.ggml.token_type"),
                   bos_id=int(need("tokenizer.ggml.bos_token_id")),
                   eos_id=int(need("tokenizer.ggml.eos_token_id")),
                   pre=str(meta.get("tokenizer.ggml.pre", "default")),
                   chat_template=meta.get("tokenizer.chat_template"))

    # -- encode ---------------------------------------------------------------------------------

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of text; special tokens written literally in text become their own id."""
        ids = [self.bos_id] if bos else []
        parts = self._special_re.split(text) if self._special_re else [text]
        for k, part in enumerate(parts):
            if k % 2:  # re.split puts the captured specials at odd indices
                ids.append(self._ids[part])
            else:
                for piece in pretokenize(part, self.pre):
                    ids.extend(self._encode_piece(piece))
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        # surrogatepass: a lone surrogate still becomes bytes (decoded back as U+FFFD).
        syms = tuple(_BYTE_CHARS[b] for b in piece.encode("utf-8", "surrogatepass"))
        while len(syms) > 1:
            # Apply the lowest-rank pair everywhere it occurs, left to right; a merge never
            # recreates its own pair, so this equals one-merge-at-a-time BPE (GPT-2's loop).
            ranked = [(self._ranks.get(p), p) for p in set(zip(syms, syms[1:]))]
            ranked = [rp for rp in ranked if rp[0] is not None]
            if not ranked:
                break
            syms = _merge_pair(syms, *min(ranked)[1])
        ids = []
        for sym in syms:
            i = self._ids.get(sym)
            # A merge whose result is not a token (a broken merge list) falls back to bytes.
            ids.extend([i] if i is not None else [self._byte_id(c) for c in sym])
        if len(self._cache) > 100_000:  # bound memory on long sessions of unique text
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def _byte_id(self, char: str) -> int:
        i = self._byte_ids[_CHAR_TO_BYTE[char]]
        if i is None:
            raise InputError(f"tokenizer.ggml.tokens: no token for byte "
                             f"0x{_CHAR_TO_BYTE[char]:02X} ({char!r}); the vocabulary is not "
                             "byte-complete")
        return i

    # -- decode ---------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens: their UTF-8 text)."""
        if not 0 <= int(token_id) < self.vocab_size:
            raise InputError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        return self._token_bytes[int(token_id)]

    def decode(self, ids) -> str:
        """Text of a token sequence; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def decode_stream(self) -> "StreamDecoder":
        """An incremental decoder: ``push(id)`` returns the text completed by that token."""
        return StreamDecoder(self)

    # -- chat -----------------------------------------------------------------------------------

    def chat(self, user: str, system: str | None = None, thinking: bool = False) -> list[int]:
        """Prompt ids for one user turn in DeepSeek-V4's chat format:

        BOS, system text, <｜User｜> user <｜Assistant｜>, then </think> (answer directly) or
        <think> (reason first). The GGUF's Jinja chat_template is not run: the layout is fixed
        for the model family (official renderer encoding_dsv4.py), so it is built here.
        """
        names = (USER_TEXT, ASSISTANT_TEXT, THINK_TEXT, END_THINK_TEXT)
        missing = [n for n in names if n not in self._ids]
        if missing:
            raise InputError(f"tokenizer.ggml.tokens: the chat format needs special tokens "
                             f"missing from the vocabulary: {', '.join(missing)}")
        user_id, assistant_id, think_id, end_think_id = (self._ids[n] for n in names)
        ids = [self.bos_id]
        if system:
            ids += self.encode(system)
        ids += [user_id, *self.encode(user), assistant_id]
        ids.append(think_id if thinking else end_think_id)
        return ids


def _token_to_bytes(token: str, token_type: int) -> bytes:
    if token_type in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
        return token.encode("utf-8")
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:  # characters outside the byte alphabet (e.g. a special typed NORMAL)
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8")
                        for c in token)


class StreamDecoder:
    """Turns a stream of token ids into text as soon as each UTF-8 character is complete.

    A byte-level token can end in the middle of a multi-byte character ("🙂" may be four
    tokens), so the incomplete tail is held back; invalid sequences become U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one token; return the newly completed text (possibly "")."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Text still held back at the end of the stream (an unfinished character -> U+FFFD)."""
        return self._utf8.decode(b"", final=True)


# ---------------------------------------------------------------------------------------------
# A small BPE trainer for synthetic models
# ---------------------------------------------------------------------------------------------

def build_byte_bpe_vocab(n_vocab: int, corpus: str, special: list[str]
                         ) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types) of exactly n_vocab entries, learned from corpus.

    Layout: BOS (id 0), EOS (id 1), the rest of `special` (CONTROL), the 256 byte tokens
    (NORMAL, byte b at id len(specials) + b), then one token per learned merge. Training is
    classic BPE over the joyai pre-tokenizer's pieces: repeatedly merge the most frequent
    adjacent pair, ties broken by the lexicographically smallest pair, so the result depends
    only on the arguments. Pairs whose merged text already is a token are skipped (e.g. a
    corpus piece spelling "<think>" must not turn into the control token). If the corpus runs
    out of pairs first, the rest is filled with "<unusedK>" tokens (UNUSED).
    """
    specials = [BOS_TEXT, EOS_TEXT] + [s for s in special if s not in (BOS_TEXT, EOS_TEXT)]
    tokens = specials + _BYTE_CHARS
    if len(set(tokens)) != len(tokens):
        raise InputError("special: duplicate special tokens or one equal to a byte token")
    if n_vocab < len(tokens):
        raise InputError(f"n_vocab: {n_vocab} is below the {len(tokens)} special + byte tokens")
    types = [TOKEN_CONTROL] * len(specials) + [TOKEN_NORMAL] * 256
    known, merges = set(tokens), []

    words = Counter(tuple(_BYTE_CHARS[b] for b in piece.encode("utf-8", "surrogatepass"))
                    for piece in pretokenize(corpus, JOYAI_PRES[0]))
    while len(tokens) < n_vocab:
        pairs = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        candidates = [(-count, pair) for pair, count in pairs.items()
                      if pair[0] + pair[1] not in known]
        if not candidates:
            break
        left, right = min(candidates)[1]  # highest count, then smallest (left, right)
        merges.append(f"{left} {right}")
        tokens.append(left + right)
        types.append(TOKEN_NORMAL)
        known.add(left + right)
        words = Counter({_merge_pair(w, left, right): f for w, f in words.items()})

    k = 0
    while len(tokens) < n_vocab:
        if f"<unused{k}>" not in known:
            tokens.append(f"<unused{k}>")
            types.append(TOKEN_UNUSED)
        k += 1
    return tokens, merges, types


def _merge_pair(word: tuple[str, ...], left: str, right: str) -> tuple[str, ...]:
    """word with every (left, right) neighbour pair, scanned left to right, joined into one."""
    out, k = [], 0
    while k < len(word):
        if k + 1 < len(word) and word[k] == left and word[k + 1] == right:
            out.append(left + right)
            k += 2
        else:
            out.append(word[k])
            k += 1
    return tuple(out)
