"""Small real data sets that need no download: scikit-learn's digits (also as captioned image pairs)
and the Planetoid citation graphs Cora and Citeseer (shipped in ``data/planetoid``; PubMed with
``python -m carlskit.data fetch planetoid pubmed``), translation corpora from gettext catalogs
(``data/translation``: version 1, 98 languages from Django's; version 2, 108 languages from Django,
Wagtail, Sphinx, django-allauth and the JupyterLab language packs) and a shared sentencepiece
vocabulary trained on version 2's training split."""

from carlskit.data._captions import VOCABULARY, PairedDataset, load_captioned_digits
from carlskit.data._datasets import (
    Dataset,
    DatasetNotFoundError,
    data_dir,
    data_dirs,
    load_digits,
    load_planetoid,
    neighbors_from_edges,
    planetoid_path,
    resolve_planetoid,
)
from carlskit.data._fetch import PLANETOID_SHA256, UnpinnedDatasetError, convert_planetoid, fetch_planetoid
from carlskit.data._planetoid import UnsafePickleError, load_planetoid_pickle, read_planetoid_raw
from carlskit.data._synthetic import edge_homophily, save_planetoid, synthetic_planetoid
from carlskit.data._translation import (
    LANGUAGE_ALIASES,
    TRANSLATION_CORPORA,
    TranslationCorpus,
    build_translation_corpus,
    load_translation_corpus,
    read_po_pairs,
    source_name,
    translation_corpus_path,
)
from carlskit.data._vocabulary import (
    VOCABULARY_SIZE,
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_vocabulary,
    train_vocabulary,
    training_sentences,
    vocabulary_path,
)

__all__ = ["PairedDataset", "load_captioned_digits", "VOCABULARY", "Dataset", "DatasetNotFoundError", "load_digits",
           "load_planetoid", "neighbors_from_edges", "planetoid_path", "resolve_planetoid", "data_dir", "data_dirs",
           "fetch_planetoid", "convert_planetoid", "PLANETOID_SHA256", "UnpinnedDatasetError", "UnsafePickleError",
           "load_planetoid_pickle", "read_planetoid_raw", "synthetic_planetoid", "save_planetoid", "edge_homophily",
           "TranslationCorpus", "build_translation_corpus", "load_translation_corpus", "read_po_pairs",
           "translation_corpus_path", "TRANSLATION_CORPORA", "LANGUAGE_ALIASES", "source_name", "Tokenizer",
           "ByteTokenizer", "SentencePieceTokenizer", "train_vocabulary", "load_vocabulary", "vocabulary_path",
           "training_sentences", "VOCABULARY_SIZE"]
