"""Corpus reading, the document split, and the tokenizers."""

from __future__ import annotations

import pytest

from k3.training.data import CorpusError, Document, read_documents, split_documents, strip_gutenberg
from k3.tokenizer import Tokenizer, byte_tokenizer, train_bpe


def test_read_folder_recursively_skipping_hidden(tmp_path):
    (tmp_path / "a.txt").write_text("first play\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("second play\r\nline\n")
    (tmp_path / ".hidden").write_text("not me")
    docs = read_documents(tmp_path)
    assert [d.name for d in docs] == ["a.txt", "sub/b.txt"]
    assert docs[1].text == "second play\nline\n"


def test_bad_corpora_say_what_to_do(tmp_path):
    with pytest.raises(CorpusError, match="no such file"):
        read_documents(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="holds no files"):
        read_documents(empty)
    (empty / "blank.txt").write_text("  \n")
    with pytest.raises(CorpusError, match="every file is empty"):
        read_documents(empty)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"not UTF-8 \(invalid byte 0xe9 at offset 3\).*iconv"):
        read_documents(latin)


def test_gutenberg_boilerplate_is_cut():
    text = "licence\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nthe play\n*** END OF THIS ***\nlicence"
    assert strip_gutenberg(text) == "the play\n"
    assert strip_gutenberg("no markers") == "no markers"


def test_split_is_by_document_and_seeded():
    docs = [Document(f"d{i}", "x" * (100 + i)) for i in range(20)]
    train, val = split_documents(docs, 0.1, seed=3)
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert len(train) + len(val) == 20 and 1 <= len(val) <= 3
    assert split_documents(docs, 0.1, seed=3) == (train, val)
    assert split_documents(docs, 0.1, seed=4) != (train, val)
    one_train, one_val = split_documents([Document("only", "line\n" * 100)], 0.1)
    assert one_train[0].text + one_val[0].text == "line\n" * 100 and one_val[0].text


def test_tokenizers_round_trip_and_count_bytes(tmp_path):
    text = "To be, or not to be: that is the question. Ünïcödé ✓\n"
    bpe = train_bpe([text * 50, "Whether 'tis nobler in the mind to suffer"], vocab_size=300)
    for tok in (bpe, byte_tokenizer()):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert sum(tok.token_bytes[i] for i in ids) == len(text.encode())
        assert tok.token_bytes[tok.eot_id] == 0
        tok.save(tmp_path / "tokenizer.json")
        assert Tokenizer.load(tmp_path).encode(text) == ids
    assert len(bpe.encode(text)) < len(text.encode())  # merges learned
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(["x"], vocab_size=100)
