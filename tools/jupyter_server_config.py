"""Jupyter server settings for ``make lab``: notebooks are saved without their outputs.

``make lab`` passes this file with ``--config``. Saving ``NAME.ipynb`` writes it with every output
and execution count cleared (``tools/nbstrip.py``'s rule, so the tracked file is unchanged when only
outputs changed and ``git status`` stays clean), and writes the notebook *with* its outputs to
``executed/NAME.ipynb`` beside it (git-ignored): open that to see the last run's results. The kernel's
``language_info`` stays in the saved file (and in git: ``tools/nbstrip.py`` says why), so starting a
kernel does not mark the notebook modified; git's clean filter (``.gitattributes``) covers notebooks
saved by other tools.
"""

import copy
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbstrip import strip  # noqa: E402

EXECUTED = "executed"


def save_without_outputs(model, path, contents_manager, **kwargs):
    """ContentsManager pre-save hook: keep a copy with outputs, save the notebook without them."""
    if model.get("type") != "notebook" or path.strip("/").split("/")[0] == EXECUTED:
        return
    import nbformat

    target = Path(contents_manager.root_dir) / EXECUTED / path.strip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    nbformat.write(nbformat.from_dict(copy.deepcopy(model["content"])), str(temporary))
    os.replace(temporary, target)
    strip(model["content"])  # the kernel's language_info stays: a kernel start changes nothing


# jupyter_server validates a configured pre_save_hook once per class section it loads and warns, on the
# second pass, that the hook "overrides" itself; only that self-override is silenced, any other still warns.
warnings.filterwarnings("ignore", message=r"Overriding existing pre_save_hook \(save_without_outputs\) "
                        r"with a new one \(save_without_outputs\)", category=UserWarning)
c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)
c.ContentsManager.pre_save_hook = save_without_outputs
