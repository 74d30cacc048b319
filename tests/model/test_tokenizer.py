"""Tokenizer: tiny tokenizer build -> load -> WAN-style (ids, mask), cleaning, errors, determinism."""

import json

import pytest
import torch

pytest.importorskip("tokenizers", reason="the tokenizers package (dev extra) is needed for dzmodel.model.tokenizer")

from dzmodel.model.tokenizer import TINY_CORPUS, build_tiny_tokenizer, clean_text, load_tokenizer  # noqa: E402

PROMPTS = ["pick up the red cup", "A multi-view video shows that a robot opens the top drawer and puts the spoon in it"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def test_tiny_directory_layout_and_special_ids(tiny_dir, tok):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tiny_dir / name).is_file()
    assert json.loads((tiny_dir / "special_tokens_map.json").read_text())["eos_token"] == "</s>"
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    assert tok.tokenizer.token_to_id("<unk>") == 2
    assert tok.vocab_size == 640


def test_batch_shapes_padding_mask_eos(tok):
    ids, mask = tok(PROMPTS, max_length=32)
    assert ids.shape == mask.shape == (2, 32)
    assert ids.dtype == mask.dtype == torch.int64
    lens = mask.sum(1).tolist()
    assert lens[0] < lens[1] <= 32
    for i, n in enumerate(lens):
        assert mask[i, :n].eq(1).all() and mask[i, n:].eq(0).all()  # mask is a prefix of ones
        assert ids[i, n - 1] == 1  # </s> ends every prompt
        assert ids[i, n:].eq(0).all()  # padded with <pad> = 0
        assert not ids[i, : n - 1].eq(1).any() and not ids[i, : n - 1].eq(0).any()
    # the words of the short prompt are whole pieces of the tiny vocabulary, in order
    pieces = [tok.tokenizer.id_to_token(int(t)) for t in ids[0, : lens[0] - 1]]
    assert pieces == ["\u2581pick", "\u2581up", "\u2581the", "\u2581red", "\u2581cup"]
    assert tok.decode(ids[0].tolist()) == "pick up the red cup"
    # a single string is a batch of one; no <unk> for ASCII text outside the corpus
    one, m1 = tok("Zebra 42!", max_length=16)
    assert one.shape == (1, 16) and 2 not in one[0, : int(m1.sum())].tolist()


def test_truncation_keeps_eos(tok):
    full, fmask = tok(PROMPTS, max_length=64)
    ids, mask = tok(PROMPTS, max_length=6)
    assert ids.shape == (2, 6) and mask[1].eq(1).all()
    assert ids[1, :5].tolist() == full[1, :5].tolist()
    assert ids[1, 5] == 1  # content cut to max_length - 1, then </s> (as HF's T5 tokenizer)
    assert tok("", max_length=4)[0].tolist() == [[1, 0, 0, 0]]  # an empty prompt is just </s>


def test_cleaning_is_wan_whitespace_clean(tok):
    assert clean_text("  pick\tup \n\n the   cup  ") == "pick up the cup"
    assert clean_text("fish &amp;amp; chips") == "fish & chips"  # html unescaped (repeatedly)
    assert clean_text("\u201cpick\u201d the robot\u2019s cup\u3000\uff11") == "\"pick\" the robot's cup 1"
    assert clean_text("A  B", None) == "A  B"
    assert clean_text(" A  B ", "lower") == "a b"
    a, _ = tok(["  pick up\n the   red cup "], max_length=16)
    b, _ = tok(["pick up the red cup"], max_length=16)
    assert torch.equal(a, b)


def test_build_is_deterministic(tmp_path, tiny_dir):
    again = build_tiny_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes()
    ids_a = load_tokenizer(again)(PROMPTS, max_length=40)
    ids_b = load_tokenizer(tiny_dir)(PROMPTS, max_length=40)
    assert all(torch.equal(x, y) for x, y in zip(ids_a, ids_b))
    other = build_tiny_tokenizer(tmp_path / "other", vocab_size=800)
    assert load_tokenizer(other).vocab_size == 800
    assert "robot" in TINY_CORPUS
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(tmp_path / "small", vocab_size=10)


def test_missing_directory_or_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(empty)


def test_matches_transformers_t5_tokenizer(tiny_dir, tok):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (dev extra); "
                                       "cross-check against HF's tokenizer call skipped")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    texts = PROMPTS + [""]
    for max_length in (6, 48):
        # WAN: tokenizer(texts, padding='max_length', truncation=True, max_length=L, add_special_tokens=True)
        ref = hf([clean_text(t) for t in texts], padding="max_length", truncation=True, max_length=max_length,
                 add_special_tokens=True, return_tensors="pt")
        ids, mask = tok(texts, max_length=max_length)
        assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
