"""Every Python code block of the docs (``docs/**/*.md`` and ``README.md``) runs, as pasted.

A reader pastes a page's code blocks in order into one file or one interpreter, so that is
how they run here: the ```` ```python ```` blocks of one page, top to bottom, in one
namespace, as one script (each block at its own line number in the page, blank lines
between, so a traceback's line number is the page's), run with ``sys.executable`` in a
subprocess whose working directory is a fresh temporary directory, with ``AIORL_REGISTRY``
and ``AIORL_KEY_FILE`` removed from the environment (an ``aiorl.Cluster()`` in a block is
an embedded one, as on a reader's laptop), and with a timeout. A page is one test case,
named after the page (``docs/tutorial.md``); it passes when the script exits with status 0.

Only ``python`` blocks run. Blocks in other languages (``bash``, ``yaml``, ``ebnf``, ...) and
blocks without a language (program output, diagrams) are not Python and never run; an
unlabelled block that parses as Python statements fails the check, so that code is not
left out by forgetting its label.

**Blocks that cannot run here are marked in the page, visibly to readers.** The paragraph
right before the block's opening fence is one italic sentence (it may wrap over lines)::

    *Not run in the tests: REASON.*

    ```python
    ...
    ```

with REASON saying why: needs a GPU, needs a multi-machine cluster, a fragment of worker
methods (``self``, top-level ``await``), a summary with placeholder names, ... Such a block
must still parse (top-level ``await`` allowed), and a marker line anywhere else (not right
before a ``python`` block) is an error. Pages in ``MUST_RUN`` (the tutorial, getting started,
the front pages) may not mark any block.

``python tests/system/test_docs.py`` prints, for each page, how many blocks run and how many are
marked, with the reasons, without running anything.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests._paths import REPO_ROOT

ROOT = REPO_ROOT
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")) + [
    "README.md"]
#: Pages that must run end to end, with no block marked.
MUST_RUN = {"README.md", "docs/index.md", "docs/getting-started.md", "docs/tutorial.md"}
#: A line a page's script prints when it worked (besides exiting with status 0).
EXPECTED = {
    "README.md": "[[0, 0], [1, 1], [2, 2], [3, 3]]",
    "docs/index.md": "[[0, 0], [1, 1], [2, 2], [3, 3]]",
    "docs/getting-started.md": "[[0, 0], [1, 1], [2, 2], [3, 3]]",
    "docs/tutorial.md": "accuracy: ",
    "docs/debugging.md": "DEADLOCK: rollout:0 waits recv from trainer:0",
}
#: Seconds a page's script may run (a few embedded clusters on a busy 2-core machine).
PAGE_TIMEOUT = 300

MARK = re.compile(r"^\*Not run in the tests: (?P<reason>\S.*?)\*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,})(?P<info>.*)$")

pytestmark = pytest.mark.timeout(PAGE_TIMEOUT + 60)


@dataclass
class Block:
    page: str
    line: int  # the page's line number of the block's first line of code (1-based)
    language: str  # the fence's first word, "" when none
    code: str
    not_run: str | None  # the reason given by the page's marker, or None: it runs


def read_blocks(page: str) -> tuple[list[Block], list[str]]:
    """The fenced code blocks of a page, and what is wrong with its markers."""
    lines = (ROOT / page).read_text().split("\n")
    blocks: list[Block] = []
    problems: list[str] = []
    used_marks: set[int] = set()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        info = opening["info"].strip().split()
        language = info[0].lower() if info else ""
        end = i + 1
        while end < len(lines) and not re.fullmatch(rf"\s*{fence}\s*", lines[end]):
            end += 1
        code = "\n".join(line[indent:] for line in lines[i + 1:end])
        last = i - 1  # the paragraph right before the fence: lines first..last
        while last >= 0 and not lines[last].strip():
            last -= 1
        first = last
        while first > 0 and lines[first - 1].strip():
            first -= 1
        paragraph = " ".join(line.strip() for line in lines[first:last + 1])
        mark = MARK.match(paragraph) if last >= 0 else None
        if mark:
            used_marks.add(first)
            if language != "python":
                problems.append(f"{page}:{first + 1}: a 'not run' marker before a "
                                f"{language or 'unlabelled'} block (only python blocks run)")
        blocks.append(Block(page, i + 2, language, code,
                            mark["reason"].rstrip(".") if mark else None))
        i = end + 1
    for n, line in enumerate(lines):
        if line.strip().lower().startswith("*not run in the tests") and n not in used_marks:
            problems.append(f"{page}:{n + 1}: a 'not run' marker that is not the paragraph "
                            "right before a code block, or not '*Not run in the tests: REASON.*'")
    return blocks, problems


def python_blocks(page: str) -> list[Block]:
    return [b for b in read_blocks(page)[0] if b.language == "python"]


def script_for(page: str) -> str:
    """The page's runnable python blocks, each at its own line number, blank lines between."""
    lines = (ROOT / page).read_text().split("\n")
    out = [""] * len(lines)
    for block in python_blocks(page):
        if block.not_run is None:
            for k, line in enumerate(block.code.split("\n")):
                out[block.line - 1 + k] = line
    return "\n".join(out) + "\n"


def summary(page: str) -> str:
    blocks = python_blocks(page)
    ran = sum(1 for b in blocks if b.not_run is None)
    reasons = [f"line {b.line}: {b.not_run}" for b in blocks if b.not_run is not None]
    text = f"{page}: {ran} block(s) run, {len(reasons)} marked not run"
    return text + "".join(f"\n    {r}" for r in reasons)


RUN_PAGES = [page for page in PAGES if python_blocks(page)]


def test_markers_are_well_formed_and_no_code_is_unlabelled() -> None:
    problems = []
    for page in PAGES:
        blocks, found = read_blocks(page)
        problems += found
        for b in blocks:
            if b.language:
                continue
            try:
                tree = ast.parse(b.code)
            except SyntaxError:
                continue
            if any(not isinstance(node, ast.Expr) for node in tree.body):
                problems.append(f"{page}:{b.line}: an unlabelled block that is Python code: "
                                "label it ```python (and mark it if it cannot run)")
    assert not problems, "\n".join(problems)


def test_pages_that_must_run_mark_nothing() -> None:
    marked = [f"{b.page}:{b.line} ({b.not_run})" for page in sorted(MUST_RUN)
              for b in python_blocks(page) if b.not_run is not None]
    assert not marked, f"these pages must run end to end, yet mark blocks: {marked}"
    assert all(python_blocks(page) for page in MUST_RUN)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs(page: str, tmp_path: pathlib.Path) -> None:
    print(summary(page))
    for b in python_blocks(page):
        try:
            compile(b.code, f"{page}:{b.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as e:
            pytest.fail(f"{page}:{b.line - 1 + (e.lineno or 1)}: a python block that does not "
                        f"parse: {e.msg}")
    if all(b.not_run is not None for b in python_blocks(page)):
        return  # every block is marked, with its reason; they parse, and that is all
    script = tmp_path / (page.replace("/", "_").removesuffix(".md") + ".py")
    script.write_text(script_for(page))
    env = {k: v for k, v in os.environ.items() if k not in ("AIORL_REGISTRY", "AIORL_KEY_FILE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=run_dir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=PAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and whatever it started
        output, _ = proc.communicate()
        pytest.fail(f"{page}'s code blocks did not finish in {PAGE_TIMEOUT} s; output:\n"
                    f"{output[-6000:]}")
    assert proc.returncode == 0, (
        f"{page}'s code blocks, run in order as one script (line numbers are the page's), "
        f"exited with status {proc.returncode}:\n{output[-6000:]}")
    if page in EXPECTED:
        assert EXPECTED[page] in output, f"{page}: no {EXPECTED[page]!r} in:\n{output[-6000:]}"


if __name__ == "__main__":
    for page in RUN_PAGES:
        print(summary(page))
