"""``python -m carlskit.summaries export SRC DST``: summaries to TensorBoard event files.

Prints one JSON line (counts per kind and the event file's path). Exit status 2 for usage errors
(including a missing ``SRC``), 1 for a corrupt summary file (named on stderr; ``--on-corrupt skip``
exports the intact records instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carlskit.summaries",
                                     description="Tools for carlskit summary log directories.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write TensorBoard event files",
                                 description="Write every summary of SRC (scalars, histograms, texts; array "
                                             "subsamples as histograms) to a new TensorBoard event file in DST.")
    export.add_argument("src", help="a SummaryWriter's logdir")
    export.add_argument("dst", help="TensorBoard logdir to write to (created if missing)")
    export.add_argument("--on-corrupt", choices=["raise", "skip"], default="raise",
                        help="a damaged record: stop with an error naming the file (default), or skip it")
    args = parser.parse_args(argv)
    source = Path(args.src)
    if not source.is_dir():
        parser.error(f"SRC {str(source)!r} is not a directory")
    from carlskit._errors import CorruptFileError
    from carlskit.summaries import SummaryReader

    reader = SummaryReader(source, on_corrupt=args.on_corrupt)
    try:
        result = reader.to_tensorboard(args.dst)
    except CorruptFileError as error:
        print(f"error: {error} (use --on-corrupt skip to export the intact records)", file=sys.stderr)
        return 1
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    result["corrupt_records_skipped"] = reader.corrupt_records
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
