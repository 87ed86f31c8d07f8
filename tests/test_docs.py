"""The documentation is tested: links and named paths resolve, the generated reference is current, the
architecture names every module, and every command of the README runs.

README commands: each ```bash block is run, line by line, in a fresh directory, unless an HTML comment stands
right before it: ``<!-- not-run: reason -->`` (not run, and why), or ``<!-- run-in: repository -->`` (run from
the repository root, for commands that name its files, such as its tests). A block whose first line is a
comment naming a file (``# run.toml``, ``# mywork.py``) is that file's content: it is written into the
directory first, so the commands that use it find it. ``scripts/...`` commands run from the repository;
``scripts/train.sh`` gets a run directory of its own, so the test never continues (or leaves) a run in the
repository's ``runs/``.
"""

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcnet.config.load import config_reference
from tests.helpers.launch import ROOT, clean_env

DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *DOCS,
         *sorted((ROOT / "benchmarks").glob("2*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:hpcnet|tests|scripts|jobscripts|docs|benchmarks|\.ci)/[\w./-]*$|"
                       r"^(?:README|CHANGELOG)\.md$|^pyproject\.toml$")
MODULE = re.compile(r"^hpcnet(?:\.\w+)+$")
TOPICS = ["configuration", "outputs", "data", "communication", "memory", "checkpoints", "fault-tolerance",
          "topology", "slurm", "architecture", "testing"]
"""docs/<topic>.md: one file a topic (benchmarks: benchmarks/README.md)."""
MAX_README_LINES = 250


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces as dashes."""
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (links and code spans are read from the prose only)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def test_every_topic_has_its_page_and_the_readme_is_short():
    missing = [topic for topic in TOPICS if not (ROOT / "docs" / f"{topic}.md").is_file()]
    assert not missing, f"docs/<topic>.md missing for {missing}"
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"
    readme = (ROOT / "README.md").read_text()
    unlinked = [topic for topic in TOPICS if f"docs/{topic}.md" not in readme]
    assert not unlinked, f"the README's docs index leaves out {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {_rel(dest)})")
    assert not broken, f"{_rel(page)}: broken links: {broken}"


LOGGERS = {name for path in (ROOT / "hpcnet").rglob("*.py")
           for name in re.findall(r"getLogger\(\"(hpcnet[\w.]*)\"\)", path.read_text())}
"""Logger names (``hpcnet.checkpoint``) are names a page may give too."""


def _module_exists(name: str) -> bool:
    """``hpcnet.x.y`` names a module, an attribute of the longest module prefix of it, or a logger."""
    if name in LOGGERS:
        return True
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj = importlib.import_module(module)
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_paths_and_modules_exist(page):
    """Every repository path (``hpcnet/ckpt/write.py``, ``scripts/slurm.sh``) and dotted module (``hpcnet.ckpt.write``,
    ``python -m hpcnet.comm.topology``) a page names in code exists; history (the CHANGELOG, dated records) may
    name what is gone."""
    if page.name == "CHANGELOG.md" or re.match(r"\d{4}-", page.name):
        pytest.skip("history names modules as they were")
    text = _prose(page) + "\n".join(re.findall(r"^```.*?^```", page.read_text(), flags=re.S | re.M))
    missing = set()
    for span in CODE_SPAN.findall(_prose(page)):
        for token in span.split():
            token = token.strip("()[],;:'\"")
            if REPO_PATH.match(token) and not (ROOT / token.split("::")[0]).exists():
                missing.add(token)
    for name in re.findall(r"\bhpcnet(?:\.\w+)+", text):
        name = name.rstrip(".")
        if MODULE.match(name) and not name.endswith((".h5", ".toml", ".json", ".md", ".ckpt", ".log")) \
                and not _module_exists(name):
            missing.add(name)
    assert not missing, f"{_rel(page)} names what does not exist: {sorted(missing)}"


def test_configuration_reference_is_current():
    generated = config_reference()
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == generated, (
        "docs/configuration.md is stale: regenerate it with `python -m hpcnet.train --help-config > "
        "docs/configuration.md`")


def _modules() -> set[str]:
    names = set()
    for path in (ROOT / "hpcnet").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_architecture_names_every_module_and_only_modules_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = {m.rstrip(".") for m in re.findall(r"\bhpcnet(?:\.\w+)*", text)}
    named |= {p[:-3].replace("/", ".").removesuffix(".__init__")
              for p in re.findall(r"\bhpcnet/[\w/]+\.py\b", text)}
    modules = _modules() - {m for m in _modules() if m.endswith("__main__")}
    left_out = sorted(m for m in modules if m not in named)
    assert not left_out, f"docs/architecture.md leaves out {left_out}"
    gone = sorted(m for m in named if not _module_exists(m) and m not in modules)
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def _drawn_packages(text: str) -> dict[str, tuple[int, set[str]]]:
    """The package drawing of docs/architecture.md (the first block under '## Packages'): package -> (its row, the
    packages its arrow names); a row that starts with no package continues the one above."""
    block = text.split("## Packages", 1)[1].split("```", 2)[1]
    drawn: dict[str, tuple[int, set[str]]] = {}
    for row, line in enumerate(block.splitlines()):
        found = re.match(r"(hpcnet\.\w+)\s*(?:->\s*([\w, ]+?)(?:\s{2,}|$))?", line)
        if found:
            targets = {f"hpcnet.{name.strip()}" for name in (found[2] or "").split(",") if name.strip()}
            drawn[found[1]] = (row, targets)
    return drawn


def _direct(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each package's imports less those another of its imports already brings (the transitive reduction)."""
    def below(package: str, seen: set[str]) -> set[str]:
        for dep in graph[package] - seen:
            seen.add(dep)
            below(dep, seen)
        return seen

    return {p: {d for d in deps if not any(d in below(o, set()) for o in deps - {d})} for p, deps in graph.items()}


def test_the_package_drawing_follows_the_imports():
    """docs/architecture.md draws every package below those that import it, its arrow naming the packages it
    builds on directly: the real dependencies, not an intention."""
    from tests.test_package import import_graph, package_graph

    graph = {p: deps - {"hpcnet"} for p, deps in package_graph(import_graph()).items()
             if p not in ("hpcnet", "hpcnet.__main__")}
    drawn = _drawn_packages((ROOT / "docs" / "architecture.md").read_text())
    assert set(drawn) == set(graph), f"not packages: {set(drawn) - set(graph)}; left out: {set(graph) - set(drawn)}"
    upward = sorted(f"{p} -> {d}" for p, deps in graph.items() for d in deps if drawn[d][0] < drawn[p][0])
    assert not upward, f"packages drawn above a package that imports them: {upward}"
    arrows = {p: targets for p, (_, targets) in drawn.items()}
    assert arrows == _direct(graph), {p: (sorted(arrows[p]), sorted(d)) for p, d in _direct(graph).items()
                                      if arrows[p] != d}


def test_the_drawing_reader_finds_rows_and_arrows():
    text = "## Packages\n\n```\nhpcnet.b  -> a, c   what b is\n          more of it\nhpcnet.a           a\n```\n"
    assert _drawn_packages(text) == {"hpcnet.b": (1, {"hpcnet.a", "hpcnet.c"}), "hpcnet.a": (3, set())}
    assert _direct({"x": {"y", "z"}, "y": {"z"}, "z": set()}) == {"x": {"y"}, "y": {"z"}, "z": set()}


# --- the README's commands ------------------------------------------------------------------------------

FILE_HEADER = re.compile(r"^#\s*([\w.-]+\.(?:toml|py|json))\s*$")


def readme_blocks() -> list[tuple[int, str, list[str], str]]:
    """(line, language, lines, note) of every fenced block; note: the HTML comment right before it, or ''."""
    blocks, lines = [], (ROOT / "README.md").read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            start = i
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            note = m.group(1) if (m := re.match(r"<!--\s*((?:not-run|run-in):.*?)\s*-->", before)) else ""
            blocks.append((start + 1, lang, lines[start + 1:j], note))
            i = j
        i += 1
    return blocks


def _commands(lines: list[str]) -> list[str]:
    """A block's commands: comments dropped, continuation lines joined."""
    commands, current = [], ""
    for line in lines:
        code = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not code.strip() and not current:
            continue
        current += code.rstrip("\\").rstrip() + " "
        if not code.endswith("\\"):
            commands.append(current.strip())
            current = ""
    return commands


COMMAND_BLOCKS = [(line, lines, note) for line, lang, lines, note in readme_blocks() if lang == "bash"]


def test_every_readme_block_says_what_it_is_and_why_a_command_is_not_run():
    for line, lang, _, note in readme_blocks():
        assert lang in ("bash", "toml", "python", "json", "text"), f"README.md:{line}: a block without a known language"
        if note.startswith("not-run:"):
            assert len(note) > 20, f"README.md:{line}: say why the block is not run"
        elif note:
            assert note == "run-in: repository", f"README.md:{line}: unknown note {note!r}"
    assert sum(1 for *_, note in COMMAND_BLOCKS if not note.startswith("not-run")) >= 4, "too few commands run"


def _prepare(directory: Path) -> None:
    """Write every file the README shows (a block whose first line is ``# <name>``) into ``directory``."""
    for _, _, lines, _ in readme_blocks():
        if lines and (m := FILE_HEADER.match(lines[0])):
            (directory / m.group(1)).write_text("\n".join(lines[1:]) + "\n")


README_STEPS = 5
"""The README's training commands run with train.steps at most this (an override added last): the test shows that
they run as written, which takes a few steps: the last step evaluates whatever train.eval_every is and saves
(checkpoint.at_end), which the commands after it (an export, a resume) read. The falling loss of a longer run is
tests/test_train.py's. The default job and the README's Hugging Face job train 300 steps."""


def _trains(words: list[str]) -> bool:
    """The command trains: ``hpcnet.train`` or ``scripts/train.sh``, other than for its help or its config."""
    return bool(words) and ("hpcnet.train" in words or words[0].endswith("scripts/train.sh")) and not any(
        w in ("--help", "--help-config", "--print-config") for w in words)


def _runnable(command: str, run_dir: Path) -> str:
    words = shlex.split(command)
    if words and words[0].startswith("scripts/"):
        words[0] = str(ROOT / words[0])
        if words[0].endswith("scripts/train.sh"):  # its own run (and checkpoint) directory, not the repository's
            words.append(f"run.dir={run_dir}")
    steps = [int(w.split("=", 1)[1]) for w in words if w.startswith("train.steps=")]
    if _trains(words) and (not steps or steps[-1] > README_STEPS):
        words.append(f"train.steps={README_STEPS}")
    return shlex.join(words) if "|" not in command and ">" not in command else command


@pytest.mark.launch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("line,lines,note", COMMAND_BLOCKS, ids=[f"README.md:{b[0]}" for b in COMMAND_BLOCKS])
def test_readme_commands_run(tmp_path, line, lines, note):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own processes: runs in the serial pass")
    if note.startswith("not-run"):
        pytest.skip(f"README.md:{line}: {note}")
    _prepare(tmp_path)
    env = clean_env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for command in _commands(lines):
        if command.startswith("scripts/test.sh"):
            continue  # the suite itself: CI (.ci/run) runs exactly this command
        cwd = ROOT if note == "run-in: repository" else tmp_path
        result = subprocess.run(["bash", "-c", _runnable(command, tmp_path / "runs")], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=540)
        assert result.returncode == 0, (f"README.md:{line}: `{command}` exited {result.returncode}\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def test_the_code_points_to_pages_that_exist():
    """Docstrings, messages and scripts name docs/<topic>.md and benchmark records: those files exist."""
    sources = [*(ROOT / "hpcnet").rglob("*.py"), *(ROOT / "scripts").iterdir(), *(ROOT / "jobscripts").iterdir()]
    missing = set()
    for path in sources:
        for name in re.findall(r"\b(?:docs|benchmarks)/[\w.-]+\.md\b", path.read_text()):
            if not (ROOT / name).is_file():
                missing.add(f"{_rel(path)}: {name}")
    assert not missing, sorted(missing)
