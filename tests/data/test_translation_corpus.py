"""The catalog corpus builder on small catalogs written here (.po and .mo, several sources), and the
shipped corpora: version 1 (Django) and version 2 (five sources)."""

import gzip
import io

import pytest

from carlskit import CorruptFileError
from carlskit.data import build_translation_corpus, load_translation_corpus, read_po_pairs
from carlskit.data.__main__ import main
from carlskit.data._translation import _split_key

FRENCH = r'''
msgid ""
msgstr ""
"Language: fr\n"
"Content-Type: text/plain; charset=UTF-8\n"
"Plural-Forms: nplurals=2; plural=(n > 1);\n"

msgid "Save"
msgstr "Enregistrer"

msgid "Delete"
msgstr ""

#, fuzzy
msgid "Add another"
msgstr "Ajouter un autre"

msgid "%(name)s was added."
msgstr "%(name)s a été ajouté."

msgid "%(name)s was changed."
msgstr "L’objet a été modifié."

msgid "%(count)d item"
msgid_plural "%(count)d items"
msgstr[0] "%(count)d élément"
msgstr[1] "%(count)d éléments"

msgid "Log   in"
msgstr "Connexion"

#~ msgid "Old"
#~ msgstr "Ancien"
'''

JAPANESE = r'''
msgid ""
msgstr ""
"Language: ja\n"
"Content-Type: text/plain; charset=UTF-8\n"
"Plural-Forms: nplurals=1; plural=0;\n"

msgid "Save"
msgstr "保存"

msgid "%(count)d item"
msgid_plural "%(count)d items"
msgstr[0] "%(count)d 個"
'''


@pytest.fixture
def catalogs(tmp_path):
    for language, text in (("fr", FRENCH), ("ja", JAPANESE)):
        for app in ("admin", "auth"):  # the same catalog in two apps: duplicates
            folder = tmp_path / "pkg" / app / "locale" / language / "LC_MESSAGES"
            folder.mkdir(parents=True)
            (folder / "django.po").write_text(text, encoding="utf-8")
    return tmp_path / "pkg"


def test_pairs_drop_empty_fuzzy_obsolete_and_broken_placeholders_and_handle_plurals(catalogs):
    pairs = set(read_po_pairs([catalogs]))
    assert pairs == {
        ("fr", "Save", "Enregistrer"),
        ("fr", "%(name)s was added.", "%(name)s a été ajouté."),
        ("fr", "%(count)d item", "%(count)d élément"),
        ("fr", "%(count)d items", "%(count)d éléments"),
        ("fr", "Log in", "Connexion"),
        ("ja", "Save", "保存"),
        ("ja", "%(count)d item", "%(count)d 個"),  # one plural form serves both English forms
        ("ja", "%(count)d items", "%(count)d 個"),
    }


def test_build_dedups_splits_by_english_sentence_and_round_trips(catalogs, tmp_path):
    output = tmp_path / "out" / "corpus.json.gz"
    built = build_translation_corpus([catalogs], output, valid_fraction=0.3, test_fraction=0.3, seed=1)
    loaded = load_translation_corpus(output)
    assert loaded.pairs == built.pairs and loaded.num_pairs() == 8  # duplicates of the second app dropped
    split_of = {}
    for language in loaded.pairs:
        for split, pairs in loaded.pairs[language].items():
            for english, _ in pairs:
                assert split_of.setdefault(english, split) == split  # one split per English sentence
    assert set(split_of.values()) == {"train", "valid", "test"}  # seed 1 puts these 5 sentences in all three
    again = tmp_path / "again.json.gz"
    build_translation_corpus([catalogs], again, valid_fraction=0.3, test_fraction=0.3, seed=1)
    assert again.read_bytes() == output.read_bytes()  # reproducible


def test_damage_is_refused_and_bad_arguments_name_themselves(catalogs, tmp_path):
    output = tmp_path / "corpus.json.gz"
    build_translation_corpus([catalogs], output)
    text = gzip.decompress(output.read_bytes()).replace("Enregistrer".encode(), "Enregistrez".encode())
    output.write_bytes(gzip.compress(text))
    with pytest.raises(CorruptFileError):
        load_translation_corpus(output)
    output.write_bytes(b"not gzip")
    with pytest.raises(CorruptFileError):
        load_translation_corpus(output)
    with pytest.raises(ValueError, match="test_fraction"):
        build_translation_corpus([catalogs], tmp_path / "x.gz", test_fraction=1.5)
    with pytest.raises(ValueError, match="sources"):
        read_po_pairs([tmp_path / "nowhere"])
    assert not (tmp_path / "x.gz").exists()


def test_command_line_builds_the_corpus(catalogs, tmp_path, capsys):
    output = tmp_path / "cli.json.gz"
    assert main(["build", "translation", str(catalogs), "--output", str(output)]) == 0
    assert load_translation_corpus(output).num_pairs() == 8


def test_shipped_corpus_is_the_django_catalogs():
    corpus = load_translation_corpus()
    sizes = corpus.sizes()
    assert len(sizes) >= 90 and corpus.num_pairs() > 60_000
    assert max(sizes.values()) > 20 * min(sizes.values())  # very unequal sizes, as in M4
    train = {english for lang in corpus.pairs for english, _ in corpus.pairs[lang]["train"]}
    test = {english for lang in corpus.pairs for english, _ in corpus.pairs[lang]["test"]}
    assert not train & test


def _write_catalog(folder, text, name="django.po"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text, encoding="utf-8")


def _compile(po_text, path):
    from babel.messages.mofile import write_mo
    from babel.messages.pofile import read_po

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        write_mo(handle, read_po(io.StringIO(po_text)))


def test_compiled_catalogs_are_read_only_where_no_po_lies_beside_them(tmp_path):
    _compile(FRENCH, tmp_path / "packs" / "fr_FR" / "LC_MESSAGES" / "lab.mo")  # .mo only: read, fr_FR -> fr
    _write_catalog(tmp_path / "packs" / "ja" / "LC_MESSAGES", JAPANESE, "lab.po")
    _compile(JAPANESE, tmp_path / "packs" / "ja" / "LC_MESSAGES" / "lab.mo")  # beside its .po: skipped
    pairs = read_po_pairs([tmp_path / "packs"])
    assert sorted(p for p in pairs if p[0] == "ja") == sorted(set(p for p in pairs if p[0] == "ja"))  # read once
    assert {p for p in pairs if p[0] == "fr"} == {  # msgfmt left the fuzzy entry out; the same rules hold
        ("fr", "Save", "Enregistrer"), ("fr", "%(name)s was added.", "%(name)s a été ajouté."),
        ("fr", "%(count)d item", "%(count)d élément"), ("fr", "%(count)d items", "%(count)d éléments"),
        ("fr", "Log in", "Connexion")}


def test_sources_are_deduplicated_counted_per_source_and_variants_share_a_split(catalogs, tmp_path):
    other = FRENCH.replace('msgid "Log   in"\nmsgstr "Connexion"', 'msgid "Log in."\nmsgstr "Connexion."')
    _write_catalog(tmp_path / "second" / "locale" / "fr_FR" / "LC_MESSAGES", other)
    corpus = build_translation_corpus([catalogs, tmp_path / "second"], tmp_path / "v2.json.gz", valid_fraction=0.3,
                                      test_fraction=0.3, seed=2)
    assert corpus.sources == ["pkg", "second"] and set(corpus.pairs) == {"fr", "ja"}  # fr_FR is fr
    counts = {name: {lang: sum(by_split.values()) for lang, by_split in sizes.items()}
              for name, sizes in corpus.source_sizes.items()}
    assert counts == {"pkg": {"fr": 5, "ja": 3}, "second": {"fr": 1}}  # only "Log in." is new in the second
    split_of = {english: split for split, pairs in corpus.pairs["fr"].items() for english, _ in pairs}
    assert split_of["Log in"] == split_of["Log in."]  # a variant in case or final punctuation: one split
    assert load_translation_corpus(tmp_path / "v2.json.gz").source_sizes == corpus.source_sizes


def test_shipped_corpus_v2_holds_every_source_and_no_test_sentence_in_training():
    corpus = load_translation_corpus(version=2)
    names = [name.rsplit("-", 1)[0] for name in corpus.sources]
    assert names == ["django", "wagtail", "sphinx", "django-allauth", "jupyterlab-language-pack"]
    assert len(corpus.pairs) >= 100 and corpus.num_pairs() > 180_000
    for language, by_split in corpus.pairs.items():  # the per-source counts add up to the pairs
        for split in ("train", "valid", "test"):
            assert sum(sizes.get(language, {}).get(split, 0) for sizes in corpus.source_sizes.values()) == \
                len(by_split[split])
    assert all(sum(map(sum, (s.values() for s in sizes.values()))) > 10_000 for sizes in corpus.source_sizes.values())
    # every source's pairs are pooled here: a test sentence (or its variant in case or final
    # punctuation) in the training pairs of any language from any source would show
    key = _split_key
    train = {key(english) for lang in corpus.pairs for english, _ in corpus.pairs[lang]["train"]}
    test = {key(english) for lang in corpus.pairs for english, _ in corpus.pairs[lang]["test"]}
    assert len(test) > 500 and not train & test
    assert load_translation_corpus().num_pairs() < corpus.num_pairs()  # version 1 stays the default
