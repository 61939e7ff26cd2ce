"""Small real data sets that need no download: scikit-learn's digits (also as captioned image pairs)
and the Planetoid citation graphs Cora and Citeseer (shipped in ``data/planetoid``; PubMed with
``python -m carlskit.data fetch planetoid pubmed``), and a 98-language translation corpus from Django's
``.po`` catalogs (``data/translation``)."""

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
    TranslationCorpus,
    build_translation_corpus,
    load_translation_corpus,
    read_po_pairs,
    translation_corpus_path,
)

__all__ = ["PairedDataset", "load_captioned_digits", "VOCABULARY", "Dataset", "DatasetNotFoundError", "load_digits",
           "load_planetoid", "neighbors_from_edges", "planetoid_path", "resolve_planetoid", "data_dir", "data_dirs",
           "fetch_planetoid", "convert_planetoid", "PLANETOID_SHA256", "UnpinnedDatasetError", "UnsafePickleError",
           "load_planetoid_pickle", "read_planetoid_raw", "synthetic_planetoid", "save_planetoid", "edge_homophily",
           "TranslationCorpus", "build_translation_corpus", "load_translation_corpus", "read_po_pairs",
           "translation_corpus_path"]
