"""Every Python snippet in the README and the guide pages (docs/guide) runs as written.

The snippets run in order in one fresh process and one namespace (as a reader pastes them into one
notebook; later ones use `client` and `bank` from earlier ones), in a scratch directory; their
`carlskit.connect()` calls start embedded clusters as they would for a reader. Three problem sizes are
shrunk (training and outer steps), by replacements that must match the README exactly. Two cluster starts and
the MoE and meta-training compilations dominate its time: 4.5 minutes on the shared 2-core machine
at load average ~12 (meta-training 76 s, MoE 73 s, the CARLS loop 54 s, the first cluster 37 s); a
quiet machine is several times faster.
Snippets marked ``<!-- tests/test_readme.py: compile only (reason) -->`` (an HPC queue, Kubernetes)
are compiled, not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILE_ONLY = re.compile(r"<!-- tests/test_readme\.py: compile only \((.+)\) -->\s*$")
# README text -> what the test runs instead (fewer steps; same code paths).
SMALLER = {
    "steps=300, block=False)": "steps=20, block=False)",
    "model.fit(tokens[:1792], steps=300,": "model.fit(tokens[:1792], steps=10,",
    "training.wait(200) ": "training.wait(20) ",  # the meta-training cluster: 22 s -> 6 s on a quiet machine
}

RUNNER = r'''
import json, sys, time
if __name__ == "__main__":  # carlskit.connect() starts Dask workers with spawn
    namespace = {"__name__": "__main__"}
    try:
        for block in json.loads(sys.argv[1]):
            code = compile(block["source"], block["where"], "exec")
            if block["compile_only"]:
                continue
            started = time.perf_counter()
            exec(code, namespace)
            print(f"{block['where']}: ran in {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        client = namespace.get("client")
        if client is not None:
            client.close()
'''


def guide_files() -> list[Path]:
    """The README, then the guide pages in the order of ``docs/guide/index.md``'s table of contents
    (the order a reader follows them, and the order their snippets build on each other)."""
    files = [ROOT / "README.md"]
    index = ROOT / "docs" / "guide" / "index.md"
    toctree = re.search(r"```\{toctree\}\n(.*?)```", index.read_text(encoding="utf-8"), flags=re.DOTALL)
    if toctree:
        files += [index.parent / f"{entry.strip()}.md" for entry in toctree.group(1).splitlines()
                  if entry.strip() and not entry.startswith(":")]
    return files


def readme_blocks() -> list[dict]:
    blocks = []
    for path in guide_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            if lines[index].strip() == "```python":
                start = index + 1
                end = next(i for i in range(start, len(lines)) if lines[i].strip() == "```")
                marker = COMPILE_ONLY.match(lines[index - 1]) if index else None
                blocks.append({"where": f"{path.relative_to(ROOT)} line {start + 1}",
                               "source": "\n".join(lines[start:end]) + "\n",
                               "compile_only": marker is not None, "reason": marker.group(1) if marker else None})
                index = end
            index += 1
    return blocks


def test_the_readme_has_python_snippets_and_few_are_only_compiled():
    blocks = readme_blocks()
    assert len(blocks) >= 8
    assert sum(block["compile_only"] for block in blocks) <= 4, "say why each is not run, and keep them few"


@pytest.mark.timeout(900)  # a loaded machine: the helpers' test runs share 2 cores
def test_every_python_snippet_in_the_readme_runs(tmp_path):
    blocks = readme_blocks()
    text = "".join(block["source"] for block in blocks)
    for old, new in SMALLER.items():
        assert text.count(old) == 1, f"the README no longer contains {old!r}: update SMALLER"
        for block in blocks:
            block["source"] = block["source"].replace(old, new)
    script = tmp_path / "run_readme.py"
    script.write_text(RUNNER)
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    out = subprocess.run([sys.executable, str(script), json.dumps(blocks)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    ran = [block for block in blocks if not block["compile_only"]]
    assert out.stdout.count(": ran in ") == len(ran)
