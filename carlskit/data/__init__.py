"""Small real data sets that need no download: scikit-learn's digits and Planetoid-style graphs."""

from carlskit.data._datasets import (
    Dataset,
    load_digits,
    load_planetoid,
    neighbors_from_edges,
    planetoid_path,
)

__all__ = ["Dataset", "load_digits", "load_planetoid", "neighbors_from_edges", "planetoid_path"]
