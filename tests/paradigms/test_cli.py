"""The paradigms' command lines: quick --help (JAX imported only after parsing), usage errors exit 2
with one line, every option documented with its default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from carlskit.paradigms._cli import paradigm_parser

PARADIGMS = ["graph_reg", "gam", "label_mining", "two_tower", "node_embeddings", "gnn"]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_help_answers_before_jax_is_imported(paradigm):
    out = _run("-X", "importtime", "-m", f"carlskit.paradigms.{paradigm}", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: python -m carlskit.paradigms.{paradigm} ")
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert imported and not [m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax")]


@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_every_option_has_help_and_a_default(paradigm):
    parser = paradigm_parser(paradigm)
    text = parser.format_help().split("\noptions:", 1)[1]
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        if action.nargs != 0:  # flags (--quiet) are off unless given
            name = action.option_strings[0]
            block = text.split(f"\n  {name}", 1)[1].split("\n  --", 1)[0]
            assert "default" in block, (name, block)


def test_parsing_resolves_the_data_set_by_name_without_importing_jax():
    code = ("import sys; from carlskit.paradigms._cli import parse_arguments; "
            "args = parse_arguments('graph_reg', ['--data', 'citeseer', '--steps', '5']); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'jax'], 'jax imported'; print(args.data)")
    out = _run("-c", code, env={"CARLSKIT_DATA": "", "CARLSKIT_PLANETOID_DIR": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith(os.path.join("data", "planetoid", "citeseer.npz"))


@pytest.mark.parametrize("paradigm, argv, message", [
    ("graph_reg", ["--data", "pubmed"], "python -m carlskit.data fetch planetoid pubmed"),
    ("gam", ["--data", "no/such/graph.npz"], "no graph file 'no/such/graph.npz'"),
    ("graph_reg", ["--steps", "0"], "--steps: must be >= 1"),
    ("two_tower", ["--negatives", "many"], "--negatives: expected an integer"),
    ("label_mining", ["--workers", "-1"], "--workers: must be >= 0"),
    ("label_mining", ["--data", "cora"], "unrecognized arguments: --data cora"),
])
def test_usage_errors_exit_2_with_one_line_and_no_traceback(tmp_path, paradigm, argv, message):
    out = _run("-m", f"carlskit.paradigms.{paradigm}", *argv, env={"CARLSKIT_DATA": str(tmp_path)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and out.stdout == ""
    error = [line for line in out.stderr.splitlines() if ": error: " in line]
    assert len(error) == 1 and message in error[0], out.stderr
    if "pubmed" in message:
        assert str(tmp_path / "planetoid" / "pubmed.npz") in error[0], "names the paths it tried"
