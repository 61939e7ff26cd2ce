"""A multilingual parallel corpus from gettext catalogs (GShard's M4 in miniature).

Translation catalogs ship inside registry packages: every ``msgid`` (English UI text) with its
``msgstr`` in one language. :func:`read_po_pairs` turns catalogs into (language, English,
translation) pairs; :func:`build_translation_corpus` deduplicates them across sources, splits them
into train / valid / test and writes one checksummed file that :func:`load_translation_corpus` reads.

Two corpora ship: version 1 (``django.json.gz``, Django's catalogs only; what notebook 10 and the
tests load by default) and version 2 (``catalogs.json.gz``: Django, Wagtail, Sphinx, django-allauth
and the JupyterLab language packs, issue 42).

Rules (each a line of :func:`read_po_pairs`):
- ``.po`` catalogs are read; a compiled ``.mo`` catalog only where no ``.po`` of the same name lies
  beside it (the JupyterLab language packs ship ``.mo`` only: ``msgfmt`` leaves fuzzy and obsolete
  entries out of a compiled catalog, so the rules below hold for it too);
- the header entry, fuzzy entries, obsolete entries and untranslated (empty) entries are dropped;
- plural entries give two pairs: the singular ``msgid`` with the form gettext picks for n = 1 and
  the ``msgid_plural`` with the form it picks for n = 2 (from the catalog's ``Plural-Forms``), so a
  language with one form (Japanese) pairs both English forms with it;
- format placeholders (``%(name)s``, ``%s``, ``%d``, ``{name}``) must appear the same number of times
  on both sides, else the pair is dropped (a translation that loses a placeholder is broken);
- whitespace runs are collapsed to one space (catalog line wrapping is not text);
- language codes are made one per language across sources (:data:`LANGUAGE_ALIASES`: the
  JupyterLab packs' ``fr_FR`` is Django's ``fr``, ``zh_CN`` its ``zh_Hans``), so a language's
  pairs from every source meet and duplicates across sources are dropped.

The split is by English sentence, the same for every language and source: the SHA-256 of a
sentence's split key (case-folded, final punctuation dropped) decides its split, so no English
sentence, nor a variant of it differing in case or final punctuation (in either direction the
model's input or its reference), is in two splits, and a language's test sentences are unseen in
every language's and every source's training data.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from carlskit._errors import CorruptFileError
from carlskit._serialization import atomic_write, dumps_checked_json, filesystem, loads_checked_json

TRANSLATION_FORMAT = "carlskit.translation/2"
_READABLE_FORMATS = ("carlskit.translation/1", TRANSLATION_FORMAT)  # 1: no source_sizes
#: The shipped corpora by version: 1 is Django's catalogs alone, 2 adds Wagtail, Sphinx,
#: django-allauth and the JupyterLab language packs (``data/translation/README.md``).
TRANSLATION_CORPORA = {1: "django.json.gz", 2: "catalogs.json.gz"}
#: Catalog language codes written one way across sources: a region that only repeats the
#: language's home country is dropped, Chinese is named by script (Django's codes), Norwegian
#: Bokmål is ``nb``, Serbian in Latin script ``sr_Latn``. Codes not listed are kept as they are.
LANGUAGE_ALIASES = {
    **{f"{lang}_{lang.upper()}": lang for lang in ("az", "de", "es", "fi", "fr", "hr", "hu", "id", "is", "it",
                                                   "lt", "nl", "pl", "pt", "ro", "ru", "sk", "tr")},
    "ar_SA": "ar", "ca_ES": "ca", "cs_CZ": "cs", "da_DK": "da", "el_GR": "el", "et_EE": "et", "he_IL": "he",
    "hi_IN": "hi", "hy_AM": "hy", "ja_JP": "ja", "ko_KR": "ko", "nb_NO": "nb", "no_NO": "nb", "sr_RS": "sr",
    "sr@latin": "sr_Latn", "uk_UA": "uk", "vi_VN": "vi", "zh_CN": "zh_Hans", "zh_TW": "zh_Hant",
    "zh_TW.Big5": "zh_Hant",
}
SPLITS = ("train", "valid", "test")
_PLACEHOLDER = re.compile(r"%\([A-Za-z_][A-Za-z0-9_]*\)[-#0 +]*\d*(?:\.\d+)?[sdifrxXeEgGc]|%[-#0 +]*\d*(?:\.\d+)?"
                          r"[sdifrxXeEgGc]|\{[A-Za-z_0-9]*\}")
_WHITESPACE = re.compile(r"\s+")
_TRAILING = re.compile(r"[\s.:;!?…。！？：]+$")


@dataclass(frozen=True)
class TranslationCorpus:
    """Parallel text by language: ``pairs[language][split]`` is a list of ``(english, translation)``.

    ``sources`` names the catalogs it was built from; ``languages`` are sorted by training size,
    largest first. ``source_sizes[source][language][split]`` counts the pairs each source brought
    (a pair two sources hold counted for the first source given; empty for a version 1 file).
    """

    pairs: dict[str, dict[str, list[tuple[str, str]]]]
    sources: list[str]
    source_sizes: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

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
    """``.../locale/<lang>/LC_MESSAGES/x.po`` -> ``<lang>``; else the file's stem (``fr.po``); then
    :data:`LANGUAGE_ALIASES`."""
    parts = name.replace("\\", "/").split("/")
    if len(parts) >= 3 and parts[-2] == "LC_MESSAGES":
        language = parts[-3]
    else:
        language = parts[-1].rsplit(".", 1)[0]
    return LANGUAGE_ALIASES.get(language, language)


def _catalog_names(names: Iterable[str]) -> list[str]:
    """The catalogs to read among file ``names``: every ``.po``, and a ``.mo`` with no ``.po`` beside it."""
    names = sorted(names)
    po = {name[:-3] for name in names if name.endswith(".po")}
    return [name for name in names if name.endswith(".po") or (name.endswith(".mo") and name[:-3] not in po)]


def _po_files(source: str | os.PathLike) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of every catalog (:func:`_catalog_names`) in a folder, a wheel / zip, or an
    installed package."""
    text = os.fspath(source)
    path = Path(text)
    if path.is_dir():
        files = {str(file): file for pattern in ("*.po", "*.mo") for file in path.rglob(pattern)}
        for name in _catalog_names(files):
            yield name, files[name].read_bytes()
    elif path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for name in _catalog_names(archive.namelist()):
                yield f"{path.name}:{name}", archive.read(name)
    elif path.is_file() and path.suffix in (".po", ".mo"):
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
    (folders searched recursively, ``.po`` / ``.mo`` files, wheels or zips, installed package
    names), in file order, duplicates kept. The rules are in this module's docstring."""
    from babel.messages.mofile import read_mo
    from babel.messages.pofile import read_po

    if isinstance(sources, (str, os.PathLike)) or not len(sources):
        raise ValueError(f"sources must be a non-empty list of folders, files or package names, got {sources!r}")
    pairs = []
    for source in sources:
        for name, data in _po_files(source):
            language = _language_of(name)
            if name.endswith(".mo"):
                catalog = read_mo(io.BytesIO(data))
            else:
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
    """The split of an English sentence: from the SHA-256 of ``seed`` and the sentence's split key
    (:func:`_split_key`), the same for every language, source and build."""
    digest = hashlib.sha256(f"{seed}\0{_split_key(english)}".encode()).digest()
    unit = int.from_bytes(digest[:8], "big") / 2.0**64
    if unit < valid_fraction:
        return "valid"
    return "test" if unit < valid_fraction + test_fraction else "train"


def _split_key(english: str) -> str:
    """What decides a sentence's split: the sentence case-folded, its final punctuation and spaces
    dropped, so "Save", "save" and "Save." (three sources' spellings of one sentence) share a
    split. On corpus version 2 the exact sentence as key left 39 of 682 test sentences (5.7%) with
    such a variant in training (corpus version 1 was built with the exact sentence as key)."""
    return _TRAILING.sub("", english.casefold())


def source_name(source: str | os.PathLike) -> str:
    """The name a source is reported under: a wheel's distribution and version
    (``wagtail-8.0.1``), the 29 ``jupyterlab_language_pack_*`` wheels as one source
    (``jupyterlab-language-pack-4.5.post3``), else the file or folder name."""
    name = os.path.basename(os.path.normpath(os.fspath(source)))
    if name.endswith(".whl"):
        distribution, version = name.split("-")[:2]
        if distribution.startswith("jupyterlab_language_pack_"):
            distribution = "jupyterlab_language_pack"
        return f"{distribution.replace('_', '-')}-{version}"
    return name


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
    translation) triples within and across sources (a triple counted for the first source holding
    it, in the order given), split by English sentence (:func:`english_split`, so a sentence is in
    one split whichever sources hold it), keep languages with at least ``min_pairs`` pairs, and
    write ``output`` atomically (gzip of a checksummed JSON document,
    :func:`carlskit._serialization.dumps_checked_json`; pairs sorted, so a build is
    byte-reproducible). Returns the corpus written, with pairs per source and language
    (``source_sizes``, named by :func:`source_name`)."""
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(f"valid_fraction + test_fraction must be < 1, got {valid_fraction} + {test_fraction}")
    if not isinstance(min_pairs, int) or min_pairs < 1:
        raise ValueError(f"min_pairs must be a positive int, got {min_pairs!r}")
    if isinstance(sources, (str, os.PathLike)) or not len(sources):
        raise ValueError(f"sources must be a non-empty list of folders, files or package names, got {sources!r}")
    owner: dict[tuple[str, str, str], str] = {}  # triple -> the first source holding it
    names = []
    for source in sources:
        name = source_name(source)
        names += [name] if name not in names else []
        for triple in read_po_pairs([source]):
            owner.setdefault(triple, name)
    pairs: dict[str, dict[str, list[tuple[str, str]]]] = {}
    split_of = {}
    for language, english, translation in sorted(owner):
        if english not in split_of:
            split_of[english] = english_split(english, valid_fraction=valid_fraction, test_fraction=test_fraction,
                                              seed=seed)
        pairs.setdefault(language, {s: [] for s in SPLITS})[split_of[english]].append((english, translation))
    pairs = {lang: by_split for lang, by_split in pairs.items()
             if sum(map(len, by_split.values())) >= min_pairs}
    if not pairs:
        raise ValueError(f"sources hold no usable translation pairs (with min_pairs={min_pairs}): {list(sources)}")
    source_sizes = {name: {} for name in names}
    for (language, english, _), name in owner.items():
        if language in pairs:
            by_split = source_sizes[name].setdefault(language, {s: 0 for s in SPLITS})
            by_split[split_of[english]] += 1
    source_sizes = {name: dict(sorted(by_language.items())) for name, by_language in source_sizes.items()}
    corpus = TranslationCorpus(pairs, names, source_sizes)
    content = {
        "format": TRANSLATION_FORMAT, "sources": corpus.sources, "seed": seed,
        "valid_fraction": valid_fraction, "test_fraction": test_fraction, "source_sizes": source_sizes,
        "pairs": {lang: {s: [list(p) for p in by_split[s]] for s in SPLITS}
                  for lang, by_split in sorted(pairs.items())},
    }
    fs, path = filesystem(output)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    atomic_write(fs, path, gzip.compress(dumps_checked_json(content), mtime=0))
    return corpus


def _corpus_file(version: int) -> str:
    if version not in TRANSLATION_CORPORA:
        raise ValueError(f"version must be one of {sorted(TRANSLATION_CORPORA)}, got {version!r}")
    return TRANSLATION_CORPORA[version]


def translation_corpus_path(version: int = 1) -> Path | None:
    """The shipped corpus ``translation/<TRANSLATION_CORPORA[version]>`` in the first of the data
    folders holding it (version 1: ``django.json.gz``, 2: ``catalogs.json.gz``)."""
    from carlskit.data._datasets import data_dirs

    file = _corpus_file(version)
    for folder in data_dirs():
        path = folder / "translation" / file
        if path.is_file():
            return path
    return None


def _read_checked_gzip_json(path: str | os.PathLike, formats: Sequence[str], what: str) -> dict:
    """The content of a gzip file of a checksummed JSON document whose ``format`` is one of
    ``formats``; every byte checked (gzip CRC, then SHA-256), damage a :class:`CorruptFileError`."""
    fs, name = filesystem(path)
    with fs.open(name, "rb") as handle:
        data = handle.read()
    try:
        text = gzip.decompress(data)
    except (OSError, EOFError, ValueError) as error:
        raise CorruptFileError(path, f"not a valid gzip file: {error}") from error
    content = loads_checked_json(text, path)
    if not isinstance(content, dict) or content.get("format") not in formats:
        raise CorruptFileError(path, f"not a carlskit {what} ({' or '.join(formats)})")
    return content


def load_translation_corpus(path: str | os.PathLike | None = None, *, version: int = 1) -> TranslationCorpus:
    """Read a corpus written by :func:`build_translation_corpus` (default: the shipped corpus of
    ``version``, :func:`translation_corpus_path`: 1 is Django's, 2 all of issue 42's sources).
    Every byte is checked (gzip CRC, then the SHA-256 of the content and its canonical bytes);
    damage raises :class:`carlskit.CorruptFileError`."""
    if path is None:
        path = translation_corpus_path(version)
        if path is None:
            from carlskit.data._datasets import DatasetNotFoundError

            raise DatasetNotFoundError(f"translation corpus data/translation/{_corpus_file(version)} not found; "
                                       "build it with: python -m carlskit.data build translation WHEELS_OR_FOLDERS "
                                       "(data/translation/README.md names them)")
    content = _read_checked_gzip_json(path, _READABLE_FORMATS, "translation corpus")
    pairs = {lang: {s: [tuple(p) for p in by_split[s]] for s in SPLITS} for lang, by_split in content["pairs"].items()}
    return TranslationCorpus(pairs, list(content["sources"]), content.get("source_sizes", {}))


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
