"""Real text for the pretrain script: a byte-level tokenizer and an indexed corpus on disk.

The default corpus is the running interpreter's own standard library (``*.py`` under
``sysconfig``'s stdlib path, site-packages excluded): present on every machine and written
by no one here. ``--data-path`` takes a user's text file or a folder of text files instead.

Each file is cut at line ends into documents of at most ``DOCUMENT_BYTES`` (so that a
single large file still splits into train and validation), and each document is tokenized
to its UTF-8 bytes followed by an end-of-document token and written once into Megatron's indexed dataset format (``.bin`` + ``.idx``, read
by ``megatron.core.datasets.IndexedDataset``) under a cache directory keyed by the
corpus's file list, sizes and modification times. Concurrent builders (every rank of a
job calls ``build_corpus``) serialize on a file lock; the first builds into a temporary
prefix and renames it into place, the rest find it built.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.tokenizers import MegatronTokenizerBase

DOCUMENT_BYTES = 16 * 1024
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".html", ".csv")


class DataPathError(ValueError):
    """The data path names nothing usable: missing, empty, or without text files."""


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as tokens 0..255, plus one end-of-document token (256)."""

    EOD = 256

    def __init__(self) -> None:
        super().__init__(path="bytes", config={})

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, "<eod>": self.EOD}

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def unique_identifiers(self) -> dict[str, str]:
        """What Megatron's dataset cache keys on."""
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", "vocab_size": "257"}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("the byte tokenizer has no chat template")


@dataclass(frozen=True)
class Corpus:
    """A built corpus: the indexed-dataset prefix and what went into it."""

    prefix: str
    files: int
    documents: int
    tokens: int
    source: str


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def find_text_files(data_path: str | None, cache_dir: str | Path | None = None) -> tuple[str, list[Path]]:
    """The text files a data path names, sorted; raises DataPathError with the reason.

    A cache folder inside the data folder is skipped: the dataset index files Megatron
    writes there (``.json`` among them) would otherwise become part of the next run's corpus."""
    if data_path is None:
        root = default_corpus_root()
        files = []
        for folder, subfolders, names in os.walk(root):
            # not into installed packages: pruned, not walked and filtered (a large site-packages
            # costs every run's start a second)
            subfolders[:] = [name for name in subfolders if name not in ("site-packages", "dist-packages")]
            files += [Path(folder) / name for name in names if name.endswith(".py")]
        source = f"python{sys.version_info.major}.{sys.version_info.minor} standard library at {root}"
    else:
        root = Path(data_path)
        if not root.exists():
            raise DataPathError(f"--data-path {data_path}: no such file or directory")
        if root.is_file():
            files = [root]
        else:
            skip = Path(cache_dir).resolve() if cache_dir is not None else None
            files = [p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                     and (skip is None or not p.resolve().is_relative_to(skip))]
            if not files:
                raise DataPathError(
                    f"--data-path {data_path}: the folder holds no text files "
                    f"(looked for {', '.join(TEXT_SUFFIXES)})"
                )
        source = str(root.resolve())
    files = sorted(p for p in files if p.stat().st_size > 0)
    if not files:
        raise DataPathError(f"--data-path {data_path or root}: every file is empty")
    return source, files


def _fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256(f"bytes+eod, documents <= {DOCUMENT_BYTES} bytes\n".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("HIGGS_CACHE_DIR", Path.home() / ".cache" / "higgs_megatron"))


def build_corpus(
    data_path: str | None,
    cache_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Corpus:
    """Tokenize and index the corpus once; later calls (and other ranks) reuse the cache."""
    source, files = find_text_files(data_path, cache_dir)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    prefix = cache / f"corpus-{_fingerprint(files)}"
    with open(cache / f"{prefix.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (Path(get_idx_path(str(prefix))).exists() and Path(get_bin_path(str(prefix))).exists()):
            _write_index(files, str(prefix), progress)
    index = IndexedDataset(str(prefix))
    return Corpus(prefix=str(prefix), files=len(files), documents=len(index.document_indices) - 1,
                  tokens=int(index.sequence_lengths.sum()), source=source)


def split_documents(data: bytes, limit: int = DOCUMENT_BYTES) -> list[bytes]:
    """Cut text into pieces of at most ``limit`` bytes, at the last line end before the limit."""
    pieces = []
    start = 0
    while len(data) - start > limit:
        cut = data.rfind(b"\n", start, start + limit) + 1
        if cut <= start:
            cut = start + limit
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:])
    return pieces


def _write_index(files: list[Path], prefix: str, progress: Callable[[str], None] | None) -> None:
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=numpy.uint16)
    tokens = documents = 0
    started = time.monotonic()
    last_report = started
    for i, path in enumerate(files, 1):
        for text in split_documents(path.read_bytes()):
            data = numpy.frombuffer(text, dtype=numpy.uint8).astype(numpy.uint16)
            document = numpy.concatenate([data, numpy.array([ByteTokenizer.EOD], dtype=numpy.uint16)])
            builder.add_document(document, [document.size])
            documents += 1
            tokens += document.size
        now = time.monotonic()
        if progress is not None and (now - last_report > 1.0 or i == len(files)):
            last_report = now
            progress(
                f"building corpus index: {i}/{len(files)} files, {documents} documents, {tokens / 1e6:.1f}M tokens, "
                f"{now - started:.1f}s"
            )
    builder.finalize(get_idx_path(tmp))
    os.replace(get_bin_path(tmp), get_bin_path(prefix))
    os.replace(get_idx_path(tmp), get_idx_path(prefix))
