"""The byte tokenizer and the indexed corpus: real text, built once, read by Megatron."""

import pytest

from higgs_megatron.training.corpus import (
    ByteTokenizer, DataPathError, build_corpus, find_text_files, split_documents,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é'\n"
    ids = tok.tokenize(text)
    assert max(ids) < 256 and tok.eod == 256 and tok.vocab_size == 257
    assert tok.detokenize(ids + [tok.eod]) == text


def test_split_documents_cuts_at_line_ends_and_keeps_every_byte():
    data = b"".join(f"line {i}\n".encode() for i in range(5000))
    pieces = split_documents(data, limit=1000)
    assert b"".join(pieces) == data
    assert all(len(p) <= 1000 for p in pieces)
    assert all(p.endswith(b"\n") for p in pieces)
    assert split_documents(b"x" * 2500, limit=1000) == [b"x" * 1000, b"x" * 1000, b"x" * 500]


def test_default_corpus_is_the_standard_library():
    source, files = find_text_files(None)
    assert "standard library" in source
    assert len(files) > 500
    assert any(f.name == "argparse.py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


def test_build_corpus_indexes_a_folder_once(tmp_path):
    data = tmp_path / "text"
    data.mkdir()
    (data / "a.txt").write_text("hello world\n" * 10)
    (data / "b.md").write_text("# title\nbody\n")
    (data / "skip.bin").write_bytes(b"\x00\x01")
    lines = []
    corpus = build_corpus(str(data), tmp_path / "cache", progress=lines.append)
    assert corpus.files == 2 and corpus.documents == 2
    assert corpus.tokens == len("hello world\n" * 10) + len("# title\nbody\n") + 2
    assert lines and "building corpus index" in lines[-1]
    dataset = IndexedDataset(corpus.prefix)
    assert ByteTokenizer().detokenize(dataset[0].tolist()) == "hello world\n" * 10
    assert dataset[0][-1] == ByteTokenizer.EOD
    again = []
    assert build_corpus(str(data), tmp_path / "cache", progress=again.append) == corpus
    assert again == [], "the second call reuses the cache"
    (data / "a.txt").write_text("changed\n")
    assert build_corpus(str(data), tmp_path / "cache").prefix != corpus.prefix


def test_data_path_errors_name_the_path(tmp_path):
    with pytest.raises(DataPathError, match="no such file"):
        find_text_files(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataPathError, match="holds no text files"):
        find_text_files(str(empty))
    (empty / "zero.txt").write_text("")
    with pytest.raises(DataPathError, match="every file is empty"):
        find_text_files(str(empty))


def test_a_cache_folder_inside_the_data_folder_is_not_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "index.json").write_text("{}")
    assert find_text_files(str(tmp_path), cache)[1] == [tmp_path / "a.txt"]
    assert len(find_text_files(str(tmp_path))[1]) == 2
