"""Train the shipped translator as a resumable background campaign (issue 42).

    python -m carlskit.moe.train_translator --campaign --run-dir runs/translator [--set d_model=256 ...]
    python -m carlskit.moe.train_translator --resume --run-dir runs/translator [--minutes 60]

``--campaign`` starts a :class:`~carlskit.moe._translator_campaign.TranslatorConfig` (its defaults,
changed by ``--set name=value``, values read as JSON) in an empty run directory; ``--resume``
continues the stored one from its newest intact state. Either runs until ``--stop-step``,
``--minutes`` or a stop: SIGINT / SIGTERM (``kill PID``) stop it at the next step with the state
saved, so interrupted runs add up. Every ``validate_every_steps`` it saves and appends a line of
validation BLEU against CPU-hours to ``campaign_log.jsonl``. Run it in the background under
``nice``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _overrides(items: list[str]) -> dict:
    from carlskit.moe._translator_campaign import TranslatorConfig

    names = {f.name for f in dataclasses.fields(TranslatorConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise SystemExit(f"--set takes name=value with name one of {sorted(names)}, got {item!r}")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--campaign", action="store_true", help="start a campaign in an empty --run-dir")
    mode.add_argument("--resume", action="store_true", help="continue the campaign in --run-dir")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a config field (JSON value)")
    parser.add_argument("--stop-step", type=int, default=None)
    parser.add_argument("--minutes", type=float, default=None)
    args = parser.parse_args(argv)

    from carlskit.moe._translator_campaign import TranslatorConfig, run_translator_campaign

    config = None
    if args.campaign:
        config = TranslatorConfig(**_overrides(args.set))
    elif args.set:
        raise SystemExit("--set applies to --campaign only: a resumed campaign keeps its stored config")
    run_translator_campaign(args.run_dir, config, resume=args.resume, stop_step=args.stop_step,
                            minutes=args.minutes, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
