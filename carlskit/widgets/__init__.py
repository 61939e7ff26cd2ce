"""Notebook dashboards: live summaries, evaluation curves per checkpoint, cluster status, the
meta-training learner's staleness histogram.

Each object shows an ipywidgets view in a notebook and falls back to HTML (``_repr_html_``) or
text (``__repr__``) where no widget front end exists.
"""

from carlskit._notebook import in_notebook
from carlskit.widgets._cluster_status import ClusterStatus
from carlskit.widgets._display import FinalFrame, Panels, smooth
from carlskit.widgets._eval_curves import EvalCurves, curves_frame
from carlskit.widgets._families import FamilyMonitor, flag_families
from carlskit.widgets._history import LivePlot
from carlskit.widgets._live import LiveSummaries
from carlskit.widgets._staleness import StalenessHistogram

__all__ = ["LiveSummaries", "LivePlot", "EvalCurves", "ClusterStatus", "StalenessHistogram", "Panels", "FinalFrame",
           "curves_frame", "smooth", "in_notebook",
           "FamilyMonitor", "flag_families"]
