"""carlskit: knowledge computed beside training, giant sparse models, trained optimizers.

Public names are re-exported here; implementations live in one subpackage per system part.
"""

from carlskit.cluster import connect, devices

__version__ = "0.1.0"

__all__ = ["connect", "devices"]
