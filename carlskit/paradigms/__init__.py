"""The CARLS learning paradigms, each runnable as ``python -m carlskit.paradigms.NAME``."""
