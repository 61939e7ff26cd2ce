"""Small real data sets that need no download: scikit-learn's digits (also as captioned image pairs)
and Planetoid-style graphs."""

from carlskit.data._captions import VOCABULARY, PairedDataset, load_captioned_digits
from carlskit.data._datasets import (
    Dataset,
    load_digits,
    load_planetoid,
    neighbors_from_edges,
    planetoid_path,
)

__all__ = ["PairedDataset", "load_captioned_digits", "VOCABULARY", "Dataset", "load_digits", "load_planetoid", "neighbors_from_edges", "planetoid_path"]
