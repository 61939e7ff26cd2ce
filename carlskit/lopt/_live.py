"""Live outer-loss curve: a matplotlib figure updated in place in a notebook, nothing elsewhere."""

from __future__ import annotations


def in_notebook() -> bool:
    """True inside a Jupyter kernel (ZMQ shell), False in scripts, tests and terminal IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class LiveCurve:
    """Outer loss against outer step, redrawn through one IPython display handle."""

    def __init__(self, title: str = "meta-training") -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        self._figure, self._axes = plt.subplots(figsize=(6, 3))
        self._title = title
        self._handle = display(self._figure, display_id=True)
        plt.close(self._figure)  # shown only through the handle, not again at cell end

    def update(self, steps: list[int], losses: list[float]) -> None:
        axes = self._axes
        axes.clear()
        axes.plot(steps, losses, lw=1, alpha=0.5, label="outer loss")
        if len(losses) >= 10:
            window = max(len(losses) // 20, 5)
            smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                      for i in range(len(losses))]
            axes.plot(steps, smooth, lw=2, label=f"running mean ({window})")
        axes.set_xlabel("outer step")
        axes.set_ylabel("outer loss")
        axes.set_title(self._title)
        axes.legend(loc="upper right")
        self._figure.tight_layout()
        if self._handle is not None:
            self._handle.update(self._figure)
