"""``python -m carlskit.data``: fetch and convert data sets.

    python -m carlskit.data fetch planetoid pubmed --unpinned   # download, verify, convert
    python -m carlskit.data fetch planetoid cora citeseer       # (shipped already; refetch them)
    python -m carlskit.data convert planetoid cora --raw DIR    # convert files you already have
    python -m carlskit.data build translation /tmp/wheels/*.whl  # .po / .mo -> data/translation/catalogs.json.gz
    python -m carlskit.data build vocabulary                    # sentencepiece on its training split
    python -m carlskit.data where                               # the folders searched, in order
    python -m carlskit.data synthetic OUT.npz --homophily 0.8 --feature-signal 0.3 --seed 0
                                                                # a stochastic-block-model graph

Exit status: 0 on success, 1 when a download or check fails, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
import time

from carlskit.data._datasets import data_dir, data_dirs

_KNOWN = ("cora", "citeseer", "pubmed")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m carlskit.data", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{fetch,convert,build,where,synthetic}")
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
    build = commands.add_parser("build", help="build a corpus from files you have (translation: .po catalogs)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    build.add_argument("family", choices=["translation", "vocabulary"],
                       help="translation: a corpus from gettext catalogs; vocabulary: a shared sentencepiece "
                            "vocabulary trained on a corpus's training split")
    build.add_argument("sources", nargs="*", help="translation: folders, .po/.mo files, wheels/zips or installed "
                                                  "package names holding gettext catalogs (LANG/LC_MESSAGES/*.po); "
                                                  "vocabulary: the corpus (default: the shipped version 2)")
    build.add_argument("--output", default=None, help="the file to write (default: DATA/translation/catalogs.json.gz "
                                                      "or DATA/translation/catalogs.vocab.json.gz)")
    build.add_argument("--vocab-size", type=int, default=None, help="vocabulary: number of pieces "
                                                                    "(default: carlskit.data.VOCABULARY_SIZE)")
    build.add_argument("--valid-fraction", type=float, default=0.1, help="share of English sentences held out "
                                                                          "for validation")
    build.add_argument("--test-fraction", type=float, default=0.1, help="share of English sentences held out "
                                                                        "for test")
    build.add_argument("--min-pairs", type=int, default=1, help="drop languages with fewer pairs")
    build.add_argument("--seed", type=int, default=0, help="seed of the split")
    commands.add_parser("where", help="print the folders searched for data sets, first match wins")
    synthetic = commands.add_parser("synthetic", help="write a Planetoid-format graph drawn from a stochastic block "
                                                      "model (carlskit.data.synthetic_planetoid)",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    synthetic.add_argument("output", help="the .npz to write")
    synthetic.add_argument("--nodes", type=int, default=2400, help="number of nodes")
    synthetic.add_argument("--classes", type=int, default=6, help="number of classes")
    synthetic.add_argument("--homophily", type=float, default=0.8, help="fraction of edges within a class")
    synthetic.add_argument("--feature-signal", type=float, default=0.3,
                           help="fraction of a node's words drawn from its class's words (0: features say nothing)")
    synthetic.add_argument("--features", type=int, default=600, help="vocabulary size")
    synthetic.add_argument("--degree", type=float, default=4.0, help="mean degree")
    synthetic.add_argument("--labels-per-class", type=int, default=20, help="labelled nodes per class")
    synthetic.add_argument("--val", type=int, default=500, help="validation nodes")
    synthetic.add_argument("--test", type=int, default=1000, help="test nodes")
    synthetic.add_argument("--seed", type=int, default=0, help="seed of the graph, features and split")
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
        if args.command == "synthetic":
            from carlskit.data._synthetic import edge_homophily, save_planetoid, synthetic_planetoid

            data = synthetic_planetoid(num_nodes=args.nodes, num_classes=args.classes, homophily=args.homophily,
                                       feature_signal=args.feature_signal, num_features=args.features,
                                       mean_degree=args.degree, labels_per_class=args.labels_per_class,
                                       num_val=args.val, num_test=args.test, seed=args.seed)
            print(f"{data}, edge homophily {edge_homophily(data):.3f}", file=sys.stderr)
            print(save_planetoid(data, args.output))
            return 0
        if args.command == "build" and args.family == "vocabulary":
            from carlskit.data._translation import TRANSLATION_CORPORA, load_translation_corpus
            from carlskit.data._vocabulary import VOCABULARY_FILE, VOCABULARY_SIZE, train_vocabulary

            if len(args.sources) > 1:
                parser.error("build vocabulary takes one corpus file")
            corpus = args.sources[0] if args.sources else data_dir() / "translation" / TRANSLATION_CORPORA[2]
            output = args.output or data_dir() / "translation" / VOCABULARY_FILE
            started = time.perf_counter()
            vocabulary = train_vocabulary(load_translation_corpus(corpus), output,
                                          vocab_size=args.vocab_size or VOCABULARY_SIZE)
            print(f"{vocabulary} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
            print(output)
            return 0
        if args.command == "build":
            from carlskit.data._translation import TRANSLATION_CORPORA, build_translation_corpus

            if not args.sources:
                parser.error("build translation needs the catalogs' sources")
            output = args.output or data_dir() / "translation" / TRANSLATION_CORPORA[2]
            started = time.perf_counter()
            corpus = build_translation_corpus(args.sources, output, valid_fraction=args.valid_fraction,
                                              test_fraction=args.test_fraction, min_pairs=args.min_pairs,
                                              seed=args.seed)
            print(f"{corpus} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
            for name, by_language in corpus.source_sizes.items():
                total = sum(sum(by_split.values()) for by_split in by_language.values())
                print(f"  {name}: {total} pairs in {len(by_language)} languages", file=sys.stderr)
            print(output)
            return 0
        if args.command == "convert":
            output = args.output or data_dir() / "planetoid" / f"{args.name}.npz"
            print(convert_planetoid(args.name, args.raw, output))
            return 0
        for name in args.names:
            print(fetch_planetoid(name, args.dir, base_url=args.base_url or PLANETOID_URL,
                                  allow_unpinned=args.unpinned, progress=not args.quiet))
    except UnpinnedDatasetError as error:  # a usage error (status 2), said in the shell's words
        parser.error(f"{error.name}: no SHA-256 sums are pinned in carlskit for this data set yet, so its "
                     f"download cannot be verified; rerun with --unpinned to accept it unverified")
    except OSError as error:  # network or disk: the offline route is one command away
        hint = ("; without network access, copy the original ind.NAME.* files here and run "
                "`python -m carlskit.data convert planetoid NAME --raw DIR`") if args.command == "fetch" else ""
        print(f"python -m carlskit.data: error: {error}{hint}", file=sys.stderr)
        return 1
    except (CorruptFileError, ValueError) as error:  # checksum, refused pickle
        print(f"python -m carlskit.data: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
