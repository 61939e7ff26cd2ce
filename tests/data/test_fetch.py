"""`python -m carlskit.data fetch`, offline: a loopback HTTP server serves the original Planetoid files."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from carlskit._errors import CorruptFileError
from carlskit.data import PLANETOID_SHA256, UnpinnedDatasetError, fetch_planetoid
from carlskit.data.__main__ import main

RAW = Path(__file__).resolve().parents[2] / "data" / "planetoid" / "raw"


class _Server:
    """http.server on 127.0.0.1 in a thread, serving ``root``; ``requests`` lists the paths asked for."""

    def __init__(self, root: Path) -> None:
        requests = self.requests = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):
                requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "served"
    shutil.copytree(RAW, root)
    server = _Server(root)
    yield server, root
    server.close()


def test_fetch_downloads_verifies_and_converts_with_a_labelled_progress_bar(served, tmp_path, capsys):
    server, _ = served
    output = fetch_planetoid("cora", tmp_path / "out", base_url=server.url)
    assert output == tmp_path / "out" / "cora.npz"
    with np.load(output) as fetched, np.load(RAW.parent / "cora.npz") as shipped:
        for key in shipped.files:
            np.testing.assert_array_equal(fetched[key], shipped[key], err_msg=key)
    assert len(server.requests) == 8
    stderr = capsys.readouterr().err
    assert "ind.cora.allx" in stderr and "2708 nodes, 5278 edges" in stderr
    fetch_planetoid("cora", tmp_path / "out", base_url=server.url, progress=False)
    assert len(server.requests) == 8, "files already present with their pinned sums are not downloaded again"


def test_a_corrupted_download_is_refused_and_nothing_is_kept(served, tmp_path):
    server, root = served
    graph = root / "ind.cora.graph"
    damaged = bytearray(graph.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    graph.write_bytes(bytes(damaged))
    with pytest.raises(CorruptFileError, match=r"ind\.cora\.graph.*differs from the pinned"):
        fetch_planetoid("cora", tmp_path / "out", base_url=server.url, progress=False)
    raw = tmp_path / "out" / "raw"
    assert not (raw / "ind.cora.graph").exists() and not list(raw.glob(".part-*"))
    assert not (tmp_path / "out" / "cora.npz").exists()


def test_a_data_set_without_pinned_sums_needs_unpinned_and_prints_the_sums_it_saw(served, tmp_path, capsys):
    server, root = served
    assert PLANETOID_SHA256["pubmed"] is None
    for path in root.glob("ind.citeseer.*"):  # any graph in the format will do: citeseer served as pubmed
        shutil.copy(path, root / path.name.replace("citeseer", "pubmed"))
    with pytest.raises(UnpinnedDatasetError, match="allow_unpinned=True"):
        fetch_planetoid("pubmed", tmp_path / "out", base_url=server.url)
    assert server.requests == []
    output = fetch_planetoid("pubmed", tmp_path / "out", base_url=server.url, allow_unpinned=True)
    assert np.load(output)["features"].shape == (3327, 3703)
    assert PLANETOID_SHA256["citeseer"]["allx"] in capsys.readouterr().err


def test_the_command_line_exits_0_1_and_2(served, tmp_path, capsys):
    server, root = served
    out = str(tmp_path / "out")
    assert main(["fetch", "planetoid", "citeseer", "--dir", out, "--base-url", server.url, "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "citeseer.npz")
    (root / "ind.cora.x").write_bytes(b"not the file")
    assert main(["fetch", "planetoid", "cora", "--dir", out, "--base-url", server.url, "--quiet"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "ind.cora.x" in error and "Traceback" not in error
    for argv in (["fetch", "planetoid", "pubmed", "--dir", out, "--base-url", server.url],
                 ["fetch", "planetoid", "imagenet"], ["fetch"]):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 2, argv
        if "pubmed" in argv:  # a shell user is told the flag, not the Python keyword
            error = capsys.readouterr().err
            assert "--unpinned" in error and "allow_unpinned" not in error, error


def test_an_unreachable_server_is_one_line_with_status_1(tmp_path, capsys):
    assert main(["fetch", "planetoid", "cora", "--dir", str(tmp_path), "--base-url", "http://127.0.0.1:9",
                 "--quiet"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error and "http://127.0.0.1:9/ind.cora.x" in error
    assert "python -m carlskit.data convert planetoid NAME --raw DIR" in error, "the offline route is named"


def test_refetching_into_the_checkout_leaves_the_shipped_files_byte_for_byte(served, tmp_path):
    server, _ = served
    folder = tmp_path / "planetoid"
    shutil.copytree(RAW.parent, folder)
    before = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    fetch_planetoid("cora", folder, base_url=server.url, progress=False)
    assert server.requests == [], "raw files with their pinned sums are not downloaded again"
    assert {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before, "git stays clean"
