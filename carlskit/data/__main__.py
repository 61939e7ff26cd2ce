"""``python -m carlskit.data``: fetch and convert data sets.

    python -m carlskit.data fetch planetoid pubmed --unpinned   # download, verify, convert
    python -m carlskit.data fetch planetoid cora citeseer       # (shipped already; refetch them)
    python -m carlskit.data convert planetoid cora --raw DIR    # convert files you already have
    python -m carlskit.data where                               # the folders searched, in order

Exit status: 0 on success, 1 when a download or check fails, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys

from carlskit.data._datasets import data_dir, data_dirs

_KNOWN = ("cora", "citeseer", "pubmed")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m carlskit.data", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{fetch,convert,where}")
    fetch = commands.add_parser("fetch", help="download a data set's original files, verify and convert them",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fetch.add_argument("family", choices=["planetoid"], help="data set family")
    fetch.add_argument("names", nargs="+", choices=_KNOWN, metavar="NAME", help=f"data sets: {', '.join(_KNOWN)}")
    fetch.add_argument("--dir", default=None, help="folder for NAME.npz and raw/ (default: DATA/planetoid, "
                                                   "DATA = $CARLSKIT_DATA, the checkout's data/ or "
                                                   "~/.cache/carlskit/data)")
    fetch.add_argument("--base-url", default=None, help="where the ind.NAME.* files lie (default: the Planetoid "
                                                        "repository on GitHub)")
    fetch.add_argument("--unpinned", action="store_true", help="accept files whose SHA-256 sums carlskit has not "
                                                               "pinned (pubmed today); prints the sums seen")
    fetch.add_argument("--quiet", action="store_true", help="no progress bars or summary on stderr")
    convert = commands.add_parser("convert", help="convert original ind.NAME.* files you already have",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    convert.add_argument("family", choices=["planetoid"], help="data set family")
    convert.add_argument("name", help="the NAME in ind.NAME.* (any graph in the Planetoid format)")
    convert.add_argument("--raw", required=True, help="folder holding ind.NAME.{x,y,tx,ty,allx,ally,graph,test.index}")
    convert.add_argument("--output", default=None, help="the .npz to write (default: DATA/planetoid/NAME.npz)")
    commands.add_parser("where", help="print the folders searched for data sets, first match wins")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "where":
        for folder in data_dirs():
            print(folder)
        return 0
    from carlskit._errors import CorruptFileError
    from carlskit.data._fetch import PLANETOID_URL, UnpinnedDatasetError, convert_planetoid, fetch_planetoid

    try:
        if args.command == "convert":
            output = args.output or data_dir() / "planetoid" / f"{args.name}.npz"
            print(convert_planetoid(args.name, args.raw, output))
            return 0
        for name in args.names:
            print(fetch_planetoid(name, args.dir, base_url=args.base_url or PLANETOID_URL,
                                  allow_unpinned=args.unpinned, progress=not args.quiet))
    except UnpinnedDatasetError as error:
        parser.error(str(error))  # a usage error: status 2
    except (OSError, CorruptFileError, ValueError) as error:  # network, disk, checksum, refused pickle
        print(f"python -m carlskit.data: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
