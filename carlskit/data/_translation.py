"""A multilingual parallel corpus from gettext ``.po`` catalogs (GShard's M4 in miniature).

Translation catalogs ship inside registry packages: every ``msgid`` (English UI text) with its
``msgstr`` in one language. :func:`read_po_pairs` turns catalogs into (language, English,
translation) pairs; :func:`build_translation_corpus` deduplicates them, splits them into
train / valid / test and writes one checksummed file that :func:`load_translation_corpus` reads.

Rules (each a line of :func:`read_po_pairs`):
- the header entry, fuzzy entries, obsolete entries and untranslated (empty) entries are dropped;
- plural entries give two pairs: the singular ``msgid`` with the form gettext picks for n = 1 and
  the ``msgid_plural`` with the form it picks for n = 2 (from the catalog's ``Plural-Forms``), so a
  language with one form (Japanese) pairs both English forms with it;
- format placeholders (``%(name)s``, ``%s``, ``%d``, ``{name}``) must appear the same number of times
  on both sides, else the pair is dropped (a translation that loses a placeholder is broken);
- whitespace runs are collapsed to one space (catalog line wrapping is not text).

The split is by English sentence, the same for every language: a sentence's SHA-256 decides its
split, so no English sentence (in either direction the model's input or its reference) is in two
splits, and a language's test sentences are unseen in every language's training data.
"""

from __future__ import annotations

import collections
import contextlib
import gettext
import gzip
import hashlib
import io
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from carlskit._errors import CorruptFileError
from carlskit._serialization import atomic_write, dumps_checked_json, filesystem, loads_checked_json

TRANSLATION_FORMAT = "carlskit.translation/1"
SPLITS = ("train", "valid", "test")
_PLACEHOLDER = re.compile(r"%\([A-Za-z_][A-Za-z0-9_]*\)[-#0 +]*\d*(?:\.\d+)?[sdifrxXeEgGc]|%[-#0 +]*\d*(?:\.\d+)?"
                          r"[sdifrxXeEgGc]|\{[A-Za-z_0-9]*\}")
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class TranslationCorpus:
    """Parallel text by language: ``pairs[language][split]`` is a list of ``(english, translation)``.

    ``sources`` names the catalogs it was built from; ``languages`` are sorted by training size,
    largest first.
    """

    pairs: dict[str, dict[str, list[tuple[str, str]]]]
    sources: list[str]

    @property
    def languages(self) -> list[str]:
        return sorted(self.pairs, key=lambda lang: (-len(self.pairs[lang]["train"]), lang))

    def sizes(self, split: str = "train") -> dict[str, int]:
        """Number of pairs per language in ``split``, largest first."""
        _check_split(split)
        return {lang: len(self.pairs[lang][split]) for lang in self.languages}

    def num_pairs(self, split: str | None = None) -> int:
        splits = SPLITS if split is None else (_check_split(split),)
        return sum(len(self.pairs[lang][s]) for lang in self.pairs for s in splits)

    def __repr__(self) -> str:
        counts = ", ".join(f"{self.num_pairs(s)} {s}" for s in SPLITS)
        return f"TranslationCorpus({len(self.pairs)} languages, {counts} pairs)"


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def _clean(text: str) -> str:
    return _WHITESPACE.sub(" ", text).strip()


def _placeholders(text: str) -> collections.Counter:
    return collections.Counter(_PLACEHOLDER.findall(text.replace("%%", "")))


def _plural_indices(catalog) -> tuple[int, int]:
    """The plural form index gettext picks for n = 1 and for n = 2 in ``catalog``'s language."""
    header = dict(catalog.mime_headers).get("Plural-Forms", "")
    match = re.search(r"plural\s*=\s*([^;]+)", header)
    if match is None:
        return 0, 1
    try:
        rule = gettext.c2py(match.group(1).strip())
        return rule(1), rule(2)
    except (ValueError, SyntaxError):
        return 0, 1


def _language_of(name: str) -> str:
    """``.../locale/<lang>/LC_MESSAGES/x.po`` -> ``<lang>``; else the file's stem (``fr.po``)."""
    parts = name.replace("\\", "/").split("/")
    if len(parts) >= 3 and parts[-2] == "LC_MESSAGES":
        return parts[-3]
    return parts[-1].rsplit(".", 1)[0]


def _po_files(source: str | os.PathLike) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of every ``.po`` file in a folder, a wheel / zip, or an installed package."""
    text = os.fspath(source)
    path = Path(text)
    if path.is_dir():
        for file in sorted(path.rglob("*.po")):
            yield str(file), file.read_bytes()
    elif path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for name in sorted(n for n in archive.namelist() if n.endswith(".po")):
                yield f"{path.name}:{name}", archive.read(name)
    elif path.is_file() and path.suffix == ".po":
        yield str(path), path.read_bytes()
    else:
        import importlib.util

        spec = importlib.util.find_spec(text) if text.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"sources: {text!r} is not a folder, a .po file, a wheel/zip or an installed package")
        for folder in spec.submodule_search_locations:
            yield from _po_files(folder)


def read_po_pairs(sources: Sequence[str | os.PathLike]) -> list[tuple[str, str, str]]:
    """``(language, english, translation)`` for every usable entry of the catalogs in ``sources``
    (folders searched recursively, ``.po`` files, wheels or zips, installed package names), in
    file order, duplicates kept. The rules are in this module's docstring."""
    from babel.messages.pofile import read_po

    if isinstance(sources, (str, os.PathLike)) or not len(sources):
        raise ValueError(f"sources must be a non-empty list of folders, files or package names, got {sources!r}")
    pairs = []
    for source in sources:
        for name, data in _po_files(source):
            language = _language_of(name)
            with contextlib.redirect_stdout(io.StringIO()):  # babel prints its parse warnings
                catalog = read_po(io.BytesIO(data), ignore_obsolete=True)
            singular_form, plural_form = _plural_indices(catalog)
            for message in catalog:
                if not message.id or message.fuzzy:
                    continue
                if isinstance(message.id, (tuple, list)):
                    forms = list(message.string) if isinstance(message.string, (tuple, list)) else [message.string]
                    candidates = [(message.id[0], forms[min(singular_form, len(forms) - 1)]),
                                  (message.id[1], forms[min(plural_form, len(forms) - 1)])]
                else:
                    candidates = [(message.id, message.string)]
                for english, translation in candidates:
                    english, translation = _clean(english or ""), _clean(translation or "")
                    if english and translation and _placeholders(english) == _placeholders(translation):
                        pairs.append((language, english, translation))
    return pairs


def english_split(english: str, *, valid_fraction: float, test_fraction: float, seed: int = 0) -> str:
    """The split of an English sentence: from the SHA-256 of ``seed`` and the sentence, the same
    for every language and every build."""
    digest = hashlib.sha256(f"{seed}\0{english}".encode()).digest()
    unit = int.from_bytes(digest[:8], "big") / 2.0**64
    if unit < valid_fraction:
        return "valid"
    return "test" if unit < valid_fraction + test_fraction else "train"


def build_translation_corpus(
    sources: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    valid_fraction: float = 0.1,
    test_fraction: float = 0.1,
    min_pairs: int = 1,
    seed: int = 0,
) -> TranslationCorpus:
    """Read the catalogs in ``sources`` (:func:`read_po_pairs`), drop duplicate (language, English,
    translation) triples, split by English sentence (:func:`english_split`), keep languages with at
    least ``min_pairs`` pairs, and write ``output`` atomically (gzip of a checksummed JSON document,
    :func:`carlskit._serialization.dumps_checked_json`; pairs sorted, so a build is byte-reproducible).
    Returns the corpus written."""
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(f"valid_fraction + test_fraction must be < 1, got {valid_fraction} + {test_fraction}")
    if not isinstance(min_pairs, int) or min_pairs < 1:
        raise ValueError(f"min_pairs must be a positive int, got {min_pairs!r}")
    triples = sorted(set(read_po_pairs(sources)))
    pairs: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for language, english, translation in triples:
        split = english_split(english, valid_fraction=valid_fraction, test_fraction=test_fraction, seed=seed)
        pairs.setdefault(language, {s: [] for s in SPLITS})[split].append((english, translation))
    pairs = {lang: by_split for lang, by_split in pairs.items()
             if sum(map(len, by_split.values())) >= min_pairs}
    if not pairs:
        raise ValueError(f"sources hold no usable translation pairs (with min_pairs={min_pairs}): {list(sources)}")
    corpus = TranslationCorpus(pairs, [os.path.basename(os.fspath(s)) for s in sources])
    content = {
        "format": TRANSLATION_FORMAT, "sources": corpus.sources, "seed": seed,
        "valid_fraction": valid_fraction, "test_fraction": test_fraction,
        "pairs": {lang: {s: [list(p) for p in by_split[s]] for s in SPLITS}
                  for lang, by_split in sorted(pairs.items())},
    }
    fs, path = filesystem(output)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    atomic_write(fs, path, gzip.compress(dumps_checked_json(content), mtime=0))
    return corpus


def translation_corpus_path() -> Path | None:
    """The shipped corpus ``translation/django.json.gz`` in the first of the data folders holding it."""
    from carlskit.data._datasets import data_dirs

    for folder in data_dirs():
        path = folder / "translation" / "django.json.gz"
        if path.is_file():
            return path
    return None


def load_translation_corpus(path: str | os.PathLike | None = None) -> TranslationCorpus:
    """Read a corpus written by :func:`build_translation_corpus` (default: the shipped Django
    corpus, :func:`translation_corpus_path`). Every byte is checked (gzip CRC, then the SHA-256 of
    the content and its canonical bytes); damage raises :class:`carlskit.CorruptFileError`."""
    if path is None:
        path = translation_corpus_path()
        if path is None:
            from carlskit.data._datasets import DatasetNotFoundError

            raise DatasetNotFoundError("translation corpus data/translation/django.json.gz not found; build it with: "
                                       "python -m carlskit.data build translation DJANGO_WHEEL_OR_FOLDER")
    fs, name = filesystem(path)
    with fs.open(name, "rb") as handle:
        data = handle.read()
    try:
        text = gzip.decompress(data)
    except (OSError, EOFError, ValueError) as error:
        raise CorruptFileError(path, f"not a valid gzip file: {error}") from error
    content = loads_checked_json(text, path)
    if not isinstance(content, dict) or content.get("format") != TRANSLATION_FORMAT:
        raise CorruptFileError(path, f"not a carlskit translation corpus ({TRANSLATION_FORMAT})")
    pairs = {lang: {s: [tuple(p) for p in by_split[s]] for s in SPLITS} for lang, by_split in content["pairs"].items()}
    return TranslationCorpus(pairs, list(content["sources"]))


def flatten_pairs(corpus: TranslationCorpus, split: str, languages: Iterable[str] | None = None,
                  ) -> list[tuple[str, str, str]]:
    """``(language, english, translation)`` of ``split`` for ``languages`` (default all), in order."""
    _check_split(split)
    languages = corpus.languages if languages is None else list(languages)
    missing = [lang for lang in languages if lang not in corpus.pairs]
    if missing:
        raise ValueError(f"languages {missing} are not in the corpus (it has {len(corpus.pairs)}: "
                         f"{corpus.languages[:8]}...)")
    return [(lang, en, xx) for lang in languages for en, xx in corpus.pairs[lang][split]]
