"""What every paradigm shares: its command line, makers running beside its trainers, an optional
Dask cluster and one JSON line of results.

The command lines are built here, from the paradigm modules' source text (their docstrings and their
configuration dataclasses' defaults, read with ``ast``), never by importing them: a paradigm module
imports JAX, which takes 10-15 s on a small machine, and ``--help`` or a usage error must answer at
once. Each paradigm module parses its arguments at its very top when run as ``__main__``, before
its own imports.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


@functools.cache
def _source(paradigm: str) -> ast.Module:
    return ast.parse((_HERE / f"{paradigm}.py").read_text(encoding="utf-8"))


def _description(paradigm: str) -> str:
    return (ast.get_docstring(_source(paradigm)) or "").split("\n\n")[0]


@functools.cache
def config_defaults(paradigm: str, name: str) -> dict[str, Any]:
    """The literal defaults of a paradigm's configuration: fields of the dataclass ``name``, or the
    keywords of a module-level ``name = Config(...)`` (e.g. ``DIGITS_CONFIG``)."""
    for node in _source(paradigm).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {field.target.id: ast.literal_eval(field.value) for field in node.body
                    if isinstance(field, ast.AnnAssign) and field.value is not None
                    and isinstance(field.target, ast.Name)}
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
    raise LookupError(f"{paradigm}.py defines no {name}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless it states its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and not any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _data_option(parser: argparse.ArgumentParser, digits: bool) -> None:
    choices = "a Planetoid data set by name (cora, citeseer; pubmed once fetched), a Planetoid-format .npz file"
    parser.add_argument("--data", default="cora", help=choices + (", or 'digits'" if digits else ""))


def _program(paradigm: str) -> str:
    """How the user called it: ``carlskit-graph-reg`` (the console script) or ``python -m ...``."""
    command = Path(sys.argv[0]).name if sys.argv else ""
    script = f"carlskit-{paradigm.replace('_', '-')}"
    return script if command == script else f"python -m carlskit.paradigms.{paradigm}"


def paradigm_parser(paradigm: str) -> argparse.ArgumentParser:
    """The command-line parser of ``python -m carlskit.paradigms.PARADIGM``; imports nothing heavy."""
    parser = argparse.ArgumentParser(
        prog=_program(paradigm), description=_description(paradigm),
        epilog="Prints one JSON object, the results, as the last line on stdout; progress bars go to stderr.",
        formatter_class=_HelpFormatter)
    if paradigm == "graph_reg":
        planetoid, digits = config_defaults(paradigm, "GraphRegConfig"), config_defaults(paradigm, "DIGITS_CONFIG")
        _data_option(parser, digits=True)
        parser.add_argument("--neighbors", type=_count(1), default=None,
                            help=f"neighbours per item read from the bank (default: {planetoid['neighbors']} on a "
                                 f"graph, {digits['neighbors']} on digits)")
        parser.add_argument("--steps", type=_count(1), default=None,
                            help=f"training steps of each model (default: {planetoid['steps']})")
        parser.add_argument("--label-fraction", type=_fraction, default=0.05,
                            help="digits only: fraction of the training images that keep their label")
    elif paradigm == "gam":
        config = config_defaults(paradigm, "GAMConfig")
        _data_option(parser, digits=False)
        parser.add_argument("--rounds", type=_count(1), default=None,
                            help=f"co-training rounds (default: {config['rounds']})")
        parser.add_argument("--steps", type=_count(1), default=None,
                            help=f"classifier and agreement-model steps per round (default: "
                                 f"{config['classifier_steps']} and {config['agreement_steps']})")
    elif paradigm == "label_mining":
        config = config_defaults(paradigm, "LabelMiningConfig")
        parser.add_argument("--steps", type=_count(1), default=None,
                            help=f"training steps of each model (default: {config['steps']})")
    elif paradigm == "two_tower":
        config = config_defaults(paradigm, "TwoTowerConfig")
        parser.add_argument("--negatives", type=_count(1), nargs="+", default=None,
                            help=f"bank negatives per batch, one training run each (default: "
                                 f"{' '.join(map(str, config['negatives']))})")
        parser.add_argument("--steps", type=_count(1), default=None,
                            help=f"training steps of each run (default: {config['steps']})")
    elif paradigm == "node_embeddings":
        config = config_defaults(paradigm, "NodeEmbeddingConfig")
        _data_option(parser, digits=False)
        parser.add_argument("--epochs", type=float, default=None,
                            help=f"passes over each trainer's skip-gram pairs (default: {config['epochs']})")
        parser.add_argument("--trainers", type=_count(1), default=1,
                            help="trainers sharing the bank tables, each on its own Dask worker (needs --workers)")
        parser.add_argument("--synthetic-nodes", type=_count(100), default=None,
                            help="instead of --data: a stochastic-block-model graph of this many nodes "
                                 "(6 classes, homophily 0.8, mean degree 8; default: none)")
        parser.add_argument("--walks-per-node", type=_count(1), default=None,
                            help=f"random walks starting at each node (default: {config['walks_per_node']})")
        parser.add_argument("--walk-length", type=_count(2), default=None,
                            help=f"nodes per walk (default: {config['walk_length']})")
        parser.add_argument("--steps", type=_count(1), default=None,
                            help="steps per trainer (default: --epochs passes over its pairs)")
        parser.add_argument("--dim", type=_count(1), default=None,
                            help=f"embedding width of both tables (default: {config['dim']})")
        parser.add_argument("--initial-accumulator-value", type=float, default=None,
                            help=f"the tables' Adagrad accumulator at a new row (default: "
                                 f"{config['initial_accumulator_value']})")
        parser.add_argument("--learning-rate", type=float, default=None,
                            help=f"the tables' Adagrad learning rate (default: {config['learning_rate']}; "
                                 f"a few walks per node need more, e.g. 0.2: see the module docstring)")
    elif paradigm == "gnn":
        config = config_defaults(paradigm, "GNNConfig")
        _data_option(parser, digits=False)
        parser.add_argument("--neighbors", type=_count(1), default=None,
                            help=f"given neighbours per node served from the bank (default: {config['neighbors']})")
        parser.add_argument("--steps", type=_count(1), default=None,
                            help=f"training steps of each model (default: {config['steps']})")
        parser.add_argument("--max-staleness", type=_count(0), default=None,
                            help=f"checkpoint versions a neighbour embedding may lag (default: "
                                 f"{config['max_staleness']})")
        parser.add_argument("--on-stale", choices=("wait", "reencode"), default=None,
                            help=f"beyond it: wait for the maker or re-encode in the trainer (default: "
                                 f"{config['on_stale']})")
        parser.add_argument("--refresh-k", type=_count(0), default=None,
                            help=f"nearest neighbours from the latest embeddings added to each node's "
                                 f"neighbourhood by a neighbour maker (default: {config['refresh_k']}: none)")
        parser.add_argument("--refresh-mix", type=float, default=None,
                            help=f"weight of the refreshed neighbours, the given graph's being 1 minus it "
                                 f"(default: {config['refresh_mix']})")
    else:
        raise ValueError(f"paradigm: unknown {paradigm!r}")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation, batches and sampling")
    parser.add_argument("--workers", type=_count(0), default=0,
                        help="Dask worker processes of an embedded cluster; 0 runs everything in this process")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or messages on stderr")
    return parser


def parse_arguments(paradigm: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a paradigm's command line without importing JAX; ``--data`` is resolved to a file here
    (exit status 2 and one line naming what was tried and the fetch command when it is missing)."""
    parser = paradigm_parser(paradigm)
    args = parser.parse_args(argv)
    if hasattr(args, "data") and not (paradigm == "graph_reg" and args.data == "digits"):  # gam, gnn need a graph
        from carlskit.data import DatasetNotFoundError, resolve_planetoid  # numpy, not JAX

        try:
            args.data = str(resolve_planetoid(args.data))
        except DatasetNotFoundError as error:
            parser.error(str(error))
    return args


def say(message: str, quiet: bool) -> None:
    """A progress message for people, on stderr (stdout carries only the JSON result)."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def run_and_print(workers: int, run: Callable[[Any, int], dict], *, quiet: bool = True) -> dict:
    """``run(client, num_shards)`` with an embedded cluster of ``workers`` worker processes (no
    cluster when 0), closed afterwards; prints the result as one JSON object, the last line."""
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    client = None
    if workers > 0:
        from carlskit.cluster import connect

        say(f"starting a Dask cluster of {workers} workers", quiet)
        client = connect(n_workers=workers)
    try:
        result = run(client, max(1, workers))
    finally:
        if client is not None:
            client.close()
    print(json.dumps(result))
    return result


@contextlib.contextmanager
def makers_running(makers: Sequence[tuple[Any, Any]], bank: Any, client: Any = None) -> Iterator[None]:
    """Run each ``(maker, checkpoint_store)`` beside the body: started on its store's checkpoints,
    and waited for until it has written the version-0 knowledge (so the first training step reads
    a filled bank); stopped when the body ends (an error in the body propagates unchanged).

    A maker slice that raised and was restarted cost at most one round of stale knowledge, so the
    run's result stands: its errors become one RuntimeWarning. A slice that spent its restart
    budget raises :class:`carlskit.ServiceGaveUpError` (its knowledge stopped following training)."""
    for maker, store in makers:
        maker.start(store, bank, client)
    try:
        for maker, _ in makers:
            maker.wait_for_version(0)
        yield
    finally:
        for maker, _ in makers:
            maker.stop()
    for maker, _ in makers:
        maker.check()
    errors = [f"{maker.name}: {error}" for maker, _ in makers for error in maker.status()["errors"]]
    if errors:
        warnings.warn(f"{len(errors)} maker error(s), each recovered by restarting its slice; the first: "
                      f"{errors[0]}", RuntimeWarning, stacklevel=3)


def console_script(paradigm: str) -> Callable[[], None]:
    """The entry point of the ``carlskit-<paradigm>`` command (``[project.scripts]`` in pyproject.toml):
    the command line of ``python -m carlskit.paradigms.<paradigm>``, installed in the environment's
    ``bin/``, so ``.venv/bin/carlskit-graph-reg`` runs in carlskit's environment without activating it
    (a bare ``python -m ...`` outside it failed with "No module named 'fsspec'"; issue 44)."""

    def run() -> None:
        parse_arguments(paradigm)  # --help and usage errors answer before the paradigm imports JAX
        importlib.import_module(f"carlskit.paradigms.{paradigm}").main()

    run.__name__ = run.__qualname__ = paradigm
    return run


graph_reg = console_script("graph_reg")
label_mining = console_script("label_mining")
gam = console_script("gam")
two_tower = console_script("two_tower")
gnn = console_script("gnn")
node_embeddings = console_script("node_embeddings")
