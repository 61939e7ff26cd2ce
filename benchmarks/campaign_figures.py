"""Progress of the committed campaigns against CPU-hours, from their logs (no training here).

Reads ``benchmarks/campaigns/<name>/campaign_log.jsonl`` (one JSON line per saved state, written by
``python -m carlskit.moe.train_translator`` and ``python -m carlskit.lopt.train_pretrained
--campaign``) and draws one figure per campaign into ``benchmarks/figures/campaign_<name>.png``:

- ``translator``: validation BLEU (greedy, sacrebleu 13a) of the ten largest languages into English
  and of English into French and German, against CPU-hours, with the same scores of the sources
  copied unchanged as dashed lines;
- ``lopt``: the validation geometric mean of the learned rule's final loss over tuned Adam's.

    python benchmarks/campaign_figures.py
Last line: JSON (per campaign: its last log line).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from carlskit._campaign import LOG_NAME, read_log  # noqa: E402


def translator_figure(records: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [r["cpu_seconds"] / 3600 for r in records]
    figure, axis = plt.subplots(figsize=(7, 4))
    for key, label, color in (("bleu_top", "10 largest languages -> en", "C0"),
                              ("bleu_en_fr", "en -> fr", "C1"), ("bleu_en_de", "en -> de", "C2")):
        axis.plot(hours, [r[f"valid_{key}"] for r in records], marker="o", color=color, label=label)
        axis.axhline(records[-1][f"copy_{key}"], color=color, linestyle="--", linewidth=1)
    axis.set_xlabel("CPU-hours (all runs of the campaign)")
    axis.set_ylabel("validation BLEU (greedy)")
    axis.set_title("Translator campaign (dashed: the source copied unchanged)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def lopt_figure(records: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["cpu_seconds"] / 3600, r["validation_geomean"]) for r in records
              if r.get("validation_geomean") is not None]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axis.set_yscale("log")
    axis.set_xlabel("CPU-hours (all runs of the campaign)")
    axis.set_ylabel("validation geomean of final loss / tuned Adam's")
    axis.set_title("Learned-optimizer campaign (1.0: as good as tuned Adam)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    campaigns = ROOT / "campaigns"
    out: dict = {}
    for name, draw in (("translator", translator_figure), ("lopt", lopt_figure)):
        records = read_log(campaigns / name / LOG_NAME)
        if not records:
            continue
        figure = ROOT / "figures" / f"campaign_{name}.png"
        os.makedirs(figure.parent, exist_ok=True)
        draw(records, figure)
        out[name] = {**records[-1], "records": len(records), "figure": str(figure.relative_to(ROOT.parent))}
        print(f"{name}: {len(records)} log lines, last {records[-1]} -> {figure}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
