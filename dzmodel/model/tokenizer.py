"""The umT5 text tokenizer, loaded from a local Hugging Face tokenizer directory.

`load_tokenizer(path)` reads `tokenizer.json` (plus `tokenizer_config.json` /
`special_tokens_map.json` for the special tokens) with the `tokenizers` library.
There is never any hub access. `TextTokenizer.__call__` reproduces WAN's
`HuggingfaceTokenizer(name, seq_len=text_len, clean='whitespace')` call:
clean the text, tokenize, append `</s>`, truncate to `max_length` (keeping the
`</s>`), pad with the pad id to exactly `max_length`, and return (ids, mask).

`build_tiny_tokenizer(out_dir)` writes a small deterministic SentencePiece-style
(Metaspace + Unigram) tokenizer directory with T5's special ids
(`<pad>`=0, `</s>`=1, `<unk>`=2), for offline tests and the embedded default.

`tokenizers` is imported lazily, so the rest of dzmodel does not need it.
"""

from __future__ import annotations

import html
import json
import re
import unicodedata
from pathlib import Path
from typing import Sequence

import torch

__all__ = [
    "TextTokenizer",
    "load_tokenizer",
    "build_tiny_tokenizer",
    "clean_text",
    "basic_clean",
    "whitespace_clean",
    "TINY_CORPUS",
]


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "dzmodel.model.tokenizer needs the `tokenizers` package (pip install 'tokenizers>=0.20', "
            "or install dzmodel with the dev extra)"
        ) from e
    return tokenizers


# --- WAN's text cleaning ------------------------------------------------------------

# Upstream's basic_clean is `ftfy.fix_text` then `html.unescape` twice then strip.
# ftfy is not a dependency here; `_light_fix_text` applies the deterministic,
# text-preserving subset of ftfy's default fixes that matters for prompts. It does
# not repair mojibake (text decoded with the wrong codec) or C1 control characters.
_ANSI_ESCAPE = re.compile("\x1b\\[((?:\\d|;)*)([a-zA-Z])")
_SINGLE_QUOTES = re.compile("[\u02bc\u2018-\u201b]")
_DOUBLE_QUOTES = re.compile("[\u201c-\u201f]")
_LINE_BREAKS = re.compile("\r\n|\r|\u2028|\u2029|\u0085")
_CONTROL_CHARS = {c: None for c in (*range(0x00, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F,
                                    *range(0x206A, 0x2070), 0xFEFF, *range(0xFFF9, 0xFFFD))}
_LIGATURES = {c: unicodedata.normalize("NFKC", chr(c)) for c in range(0xFB00, 0xFB07)}
_WIDTH = {c: unicodedata.normalize("NFKC", chr(c)) for c in (0x3000, *range(0xFF01, 0xFF5F))}


def _light_fix_text(text: str) -> str:
    if "<" not in text:  # ftfy's unescape_html="auto"
        text = html.unescape(text)
    text = _ANSI_ESCAPE.sub("", text)
    text = text.translate(_LIGATURES).translate(_WIDTH)
    text = _SINGLE_QUOTES.sub("'", text)
    text = _DOUBLE_QUOTES.sub('"', text)
    text = _LINE_BREAKS.sub("\n", text)
    text = text.translate(_CONTROL_CHARS)
    return unicodedata.normalize("NFC", text)


def basic_clean(text: str) -> str:
    text = _light_fix_text(text)
    text = html.unescape(html.unescape(text))
    return text.strip()


def whitespace_clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def clean_text(text: str, mode: str | None = "whitespace") -> str:
    """WAN's cleaning: None (as is), 'whitespace' (default for umT5) or 'lower'."""
    if mode is None:
        return text
    if mode == "whitespace":
        return whitespace_clean(basic_clean(text))
    if mode == "lower":
        return whitespace_clean(basic_clean(text)).lower()
    raise ValueError(f"unknown clean mode {mode!r}; use None, 'whitespace' or 'lower'")


# --- the tokenizer ------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value) -> str | None:
    # special tokens appear as plain strings or as AddedToken dicts {"content": ...}
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Callable: texts -> (ids [B, L] int64, mask [B, L] int64), L = max_length."""

    def __init__(self, tokenizer, eos_id: int, pad_id: int, clean: str | None = "whitespace",
                 path: str | Path | None = None):
        self.tokenizer = tokenizer
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.clean = clean
        self.path = Path(path) if path is not None else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """One text -> ids (cleaned, `</s>` appended, truncated to max_length keeping `</s>`), unpadded."""
        ids = self.tokenizer.encode(clean_text(text, self.clean), add_special_tokens=False).ids
        if max_length is not None:
            if max_length < 1:
                raise ValueError(f"max_length must be >= 1, got {max_length}")
            ids = ids[: max_length - 1]
        return ids + [self.eos_id]

    def __call__(self, texts: str | Sequence[str], max_length: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(texts, str):
            texts = [texts]
        ids = torch.full((len(texts), max_length), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(texts), max_length), dtype=torch.int64)
        for i, text in enumerate(texts):
            row = self.encode(text, max_length)
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            mask[i, : len(row)] = 1
        return ids, mask

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | Path, clean: str | None = "whitespace") -> TextTokenizer:
    """Load a local HF tokenizer directory (e.g. a copy of google/umt5-xxl). Never touches the hub."""
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in tokenizer directory {path} (expected {tok_file})")
    tokenizers = _import_tokenizers()
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    tok.no_truncation()
    tok.no_padding()

    config = _read_json(path / "tokenizer_config.json")
    special = _read_json(path / "special_tokens_map.json")
    ids = {}
    for role, default in (("eos", "</s>"), ("pad", "<pad>")):
        name = _token_content(special.get(f"{role}_token")) or _token_content(config.get(f"{role}_token")) or default
        tid = tok.token_to_id(name)
        if tid is None:
            raise ValueError(f"{role} token {name!r} is not in the vocabulary of {tok_file}")
        ids[role] = tid
    return TextTokenizer(tok, eos_id=ids["eos"], pad_id=ids["pad"], clean=clean, path=path)


# --- a tiny deterministic tokenizer -----------------------------------------------------

TINY_CORPUS = (
    # DreamZero's prompt template
    "A multi-view video shows that a robot {task} The video is split into four views: The top-left view "
    "shows the camera view from the robot's head, the top-right view shows the camera view from the right "
    "hand, the bottom-left view shows the camera view from the left hand, and the bottom-right view is a "
    "black screen (inactive view). The robot {task} the top camera, the right camera, the left camera."
    # robot instructions
    " pick up place put the it on in into onto from to of with and then open close push pull move lift "
    "grasp grab drop release slide turn rotate flip stack unstack pour wipe fold unfold press insert remove "
    "take hang sort clean arrange align reach hold carry set down off out back over under next left right "
    "front behind top bottom middle center side inside outside near far above below between cup mug bowl "
    "plate spoon fork knife bottle can box block cube ball toy towel cloth sponge drawer cabinet door lid "
    "microwave oven stove sink faucet basket tray shelf table counter rack pot pan kettle book pen marker "
    "apple banana orange lemon carrot bread egg red green blue yellow white black purple pink brown small "
    "large big tall short first second last other one two three all both each gripper arm hand object "
    "objects item items container bin cover handle button switch knob"
)

_TINY_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"()-_/&%+=*#@$[]{}<>"


def _tiny_vocab(vocab_size: int) -> list[tuple[str, float]]:
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    # Single characters (word-initial and inner) guarantee any ASCII text encodes without <unk>.
    chars = [("\u2581", -9.0)] + [(c, -10.0) for c in _TINY_CHARS] + [("\u2581" + c, -10.5) for c in _TINY_CHARS]
    words: list[str] = []
    inner: list[str] = []  # word pieces not at a word start (after '-', '/', ...), and plural 's'
    for w in re.findall(r"[A-Za-z']+", TINY_CORPUS):
        for piece in ("\u2581" + w, "\u2581" + w.lower()):
            if len(piece) > 2 and piece not in words:
                words.append(piece)
        if len(w) > 2 and w.lower() not in inner:
            inner.append(w.lower())
    minimum = len(specials) + len(chars)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (specials + characters), got {vocab_size}")
    # Whole words score above any split into characters, so Viterbi keeps them whole.
    pieces = specials + chars + [(w, -5.0) for w in words] + [(w, -6.0) for w in inner]
    pieces = pieces[:vocab_size]
    # Fill up to exactly vocab_size with never-preferred placeholders (like T5's unused ids).
    for i in range(vocab_size - len(pieces)):
        pieces.append((f"<extra_id_{i}>", -100.0))
    return pieces


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 640) -> Path:
    """Write a small deterministic umT5-like tokenizer directory and return its path.

    Metaspace pre-tokenizer + Unigram model with a fixed vocabulary (no training):
    ids 0/1/2 are `<pad>`/`</s>`/`<unk>`, then single characters, then whole words
    of a built-in robot-instruction corpus, then `<extra_id_N>` fillers so the
    vocabulary has exactly `vocab_size` entries. Same arguments -> byte-identical files.
    """
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(models.Unigram(_tiny_vocab(vocab_size), unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(tokenizers.Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in ("<pad>", "</s>", "<unk>")])
    tok.save(str(out / "tokenizer.json"), pretty=True)

    special_map = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config = {**special_map, "model_max_length": 512, "tokenizer_class": "T5Tokenizer",
              "extra_ids": 0, "additional_special_tokens": []}
    for name, data in (("special_tokens_map.json", special_map), ("tokenizer_config.json", config)):
        with open(out / name, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
    return out
