"""The code in README.md and docs/*.md: complete programs run as written, every other block compiles.

Convention: a ```python block with ``<!-- runs: python -->`` or ``<!-- runs: torchrun --nproc-per-node=N -->`` on
the line above is a complete program, which this test runs with that command in an empty folder on CPU processes;
one with ``<!-- start of: docs/FILE.md -->`` is the beginning of a program in that file, word for word, so it runs
as that program's first lines (the README's opening block: its own launch of 4 processes cost 39 s of CPU on 2
cores to run what the quickstart's program runs again); one with ``<!-- signature -->`` is a listing that is not
Python; any other block is an excerpt and must compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- (?P<marker>[^\n]*?) -->\n)?```python\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL)
#: Variables of an enclosing launcher (a test run under torchrun or SLURM) that would make a program think it
#: was launched already.
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Block:
    name: str  # path:line of the fence
    marker: str | None
    code: str


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))  # the fence's line, 1-based
            found.append(Block(f"{path.relative_to(ROOT)}:{line}", m.group("marker"), m.group("code")))
    return found


BLOCKS = blocks()
PROGRAMS = [b for b in BLOCKS if b.marker and b.marker.startswith("runs:")]
STARTS = [b for b in BLOCKS if b.marker and b.marker.startswith("start of:")]
EXCERPTS = [b for b in BLOCKS if b.marker is None]


def test_every_marker_is_known_and_readme_and_quickstart_have_programs():
    unknown = [(b.name, b.marker) for b in BLOCKS if b.marker not in (None, "signature") and b not in PROGRAMS + STARTS]
    assert not unknown, f"unknown markers (use `runs: COMMAND`, `start of: FILE` or `signature`): {unknown}"
    for program in PROGRAMS:
        command(program, Path("program.py"))  # raises for a launcher the test does not know
    for doc in ("README.md", "docs/quickstart.md"):
        assert any(b.name.startswith(f"{doc}:") for b in PROGRAMS + STARTS), f"{doc} has no block that runs"


@pytest.mark.parametrize("block", STARTS, ids=lambda b: b.name)
def test_a_start_of_block_begins_a_program_of_its_file_word_for_word(block):
    doc = block.marker.removeprefix("start of:").strip() if block.marker else ""
    programs = [p for p in PROGRAMS if p.name.rsplit(":", 1)[0] == doc]
    assert programs, f"{block.name}: `{block.marker}` names no file with a block marked `runs:`"
    assert any(p.code.startswith(block.code) for p in programs), (
        f"{block.name} is not the beginning of a program in {doc} ({[p.name for p in programs]}): copy the "
        "program's first lines into it, or change both"
    )


@pytest.mark.parametrize("block", [*PROGRAMS, *STARTS, *EXCERPTS], ids=lambda b: b.name)
def test_block_compiles(block):
    compile(block.code, block.name, "exec")


def command(block: Block, script: Path, python: str = sys.executable) -> list[str]:
    launcher, *args = block.marker.removeprefix("runs:").split() if block.marker else [""]
    if launcher == "python" and not args:  # Fabric launches its processes itself
        return [python, str(script)]
    if launcher == "torchrun":
        run = [python, "-m", "torch.distributed.run", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        return [*run, *args, str(script)]
    raise ValueError(
        f"{block.name}: `{block.marker}` names no launcher this test knows; use `runs: python` or `runs: torchrun ...`"
    )


@pytest.mark.parametrize("block", PROGRAMS, ids=lambda b: b.name)
def test_program_runs_as_written_on_cpu_processes(block, tmp_path, program_python):
    script = tmp_path / "program.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env |= {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "default"}  # CPU and gloo
    result = subprocess.run(
        command(block, script, program_python), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    output = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"{block.name} exited with {result.returncode}\n{output}"
    # a warning of ours tells the reader that the program is wrong (an unseeded model, a view returned ...)
    assert not re.search(r"modelpar/\S+\.py:\d+: \w*Warning", result.stderr), output
