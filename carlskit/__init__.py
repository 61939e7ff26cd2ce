"""carlskit: knowledge computed beside training, giant sparse models, trained optimizers.

Public names are re-exported here; implementations live in one subpackage per system part.
"""

__version__ = "0.1.0"
