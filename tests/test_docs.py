"""The README stays short and points at the command reference in docs/, whose `--help` blocks match the CLI."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptool.cli import COMMANDS

pytestmark = pytest.mark.torchfree

ROOT = Path(__file__).resolve().parents[1]


def test_command_pages_match_help() -> None:
    """`python docs/generate.py --check` fails when a page's --help block differs from the CLI's (or a command has
    no page)."""
    res = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_every_command_has_a_help_block() -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "commands").glob("*.md"))
    assert set(COMMANDS) <= set(re.findall(r"<!-- help: ([\w-]+) -->", text))


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 250
    assert "<!-- main-command -->" in readme and "<!-- test-command -->" in readme
    for target in re.findall(r"\]\(((?:docs|fixtures)/[^)#]+)\)", readme):
        assert (ROOT / target).exists(), target
    for page in (ROOT / "docs").rglob("*.md"):
        for target in re.findall(r"\]\((\.\.?/[^)#]+)\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).resolve().exists(), (page, target)


# ------------------------------------------------------------------------------------------------ console examples
# A fenced block holding `$ ckptool ...` lines followed by output is a console example. The HTML comment right
# before it says how it runs: `<!-- console: FILE, FILE as NAME, generated:NAME as NAME -->` copies those files into
# an empty folder (a repository path keeps its relative path unless `as` renames it; `generated:` names a generated
# fixture, make_fixtures.MANIFEST; `needs torch` skips it where torch is missing) and runs every command there, in
# order; `<!-- console: not run: WHY -->` excuses it. In the expected output a line `...` stands for any number of
# lines and `...` inside a line for any text; `# comment` after a command is not part of it; `$ echo $?` prints the
# previous command's exit status (any other command must exit 0).

_BLOCK = re.compile(r"(?:<!--\s*console:(?P<spec>[^\n]*?)-->\s*\n)?```[^\n]*\n(?P<body>.*?)\n```", re.S)


@dataclasses.dataclass
class ConsoleExample:
    page: str
    line: int
    spec: str | None  # the marker's text; None: no marker
    steps: list[tuple[str, list[str]]]  # (command line, expected output lines)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def console_examples(pages: list[Path] | None = None) -> list[ConsoleExample]:
    """Every fenced block of ``pages`` (README.md and docs/**/*.md) with a ``$ ckptool`` line followed by output."""
    found = []
    for page in pages or _doc_pages():
        text = page.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            steps: list[tuple[str, list[str]]] = []
            for raw in m.group("body").splitlines():
                if raw.startswith("$ "):
                    steps.append((raw[2:], []))
                elif steps:
                    steps[-1][1].append(raw.rstrip())
            if not any(cmd.startswith("ckptool ") for cmd, _ in steps):
                continue
            for _, out in steps:
                while out and not out[-1]:
                    out.pop()
            if not any(out for _, out in steps):
                continue  # commands only, no output to compare
            spec = m.group("spec").strip() if m.group("spec") is not None else None
            found.append(ConsoleExample(str(page.relative_to(ROOT)), text[:m.start("body")].count("\n"), spec,
                                        steps))
    return found


def output_matches(expected: list[str], actual: str) -> bool:
    """True when ``actual`` (a command's stdout and stderr) is ``expected``, a line ``...`` matching any number of
    lines and ``...`` inside a line any text; trailing spaces are ignored."""
    pattern = ""
    for line in expected:
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += ".*?".join(re.escape(part) for part in line.split("...")) + r"\n"
    text = "".join(line.rstrip() + "\n" for line in actual.splitlines())
    return re.fullmatch(pattern, text) is not None


def _setup(example: ConsoleExample, cwd: Path, request: pytest.FixtureRequest) -> None:
    assert example.spec is not None
    for item in filter(None, (s.strip() for s in example.spec.split(","))):
        if item == "needs torch":
            pytest.importorskip("torch")
            continue
        source, _, name = (part.strip() for part in item.partition(" as "))
        if source.startswith("generated:"):
            path = request.getfixturevalue("generated")[source.removeprefix("generated:")]
        else:
            path = ROOT / source
        dest = cwd / (name or source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if path.is_dir() else shutil.copy)(path, dest)


def _runnable() -> list[ConsoleExample]:
    return [e for e in console_examples() if e.spec is not None and not e.spec.startswith("not run")]


def test_every_console_example_is_run_or_excused() -> None:
    """A new example with output must say how it runs (or why it cannot), so it cannot drift unnoticed."""
    unmarked = [e.id for e in console_examples() if e.spec is None]
    assert not unmarked, f"console examples without a <!-- console: ... --> marker: {unmarked}"
    assert len(_runnable()) >= 5


@pytest.mark.parametrize("example", _runnable(), ids=lambda e: e.id)
def test_console_example_output_is_what_the_command_prints(example: ConsoleExample, tmp_path: Path,
                                                           request: pytest.FixtureRequest) -> None:
    _setup(example, tmp_path, request)
    env = {**os.environ, "CKPTOOL_NO_PROGRESS": "1", "COLUMNS": "200"}
    last = 0
    for command, expected in example.steps:
        argv = shlex.split(command, comments=True)
        if argv == ["echo", "$?"]:
            actual = f"{last}\n"
        else:
            assert argv[0] == "ckptool", f"{example.id}: only ckptool commands run: {command}"
            res = subprocess.run([sys.executable, "-m", "ckptool", *argv[1:]], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, check=False, timeout=300)
            actual, last = res.stdout + res.stderr, res.returncode
        assert output_matches(expected, actual), (
            f"{example.id}: `{command}` printed:\n{actual}\nthe page shows:\n" + "\n".join(expected))
        nxt = example.steps[example.steps.index((command, expected)) + 1:][:1]
        if argv != ["echo", "$?"] and not (nxt and nxt[0][0].strip() == "echo $?"):
            assert last == 0, f"{example.id}: `{command}` exited {last}"


def test_output_matching_wildcards() -> None:
    assert output_matches(["a", "...", "d"], "a\nb\nc\nd\n")
    assert output_matches(["a", "...", "d"], "a\nd")
    assert output_matches(["Wrote x (... KiB)"], "Wrote x (7.2 KiB)  \n")
    assert not output_matches(["a", "d"], "a\nb\nd\n")
    assert not output_matches(["Wrote x (7.8 KiB)"], "Wrote x (7.2 KiB)")
    assert not output_matches(["a"], "a\nextra\n")


def test_json_schema_versions_in_the_docs_are_the_commands() -> None:
    """Every ``ckptool.<command>/<N>`` the README and docs name is the schema that command's ``--json`` prints."""
    from ckptool.cli._common import schema_name
    from ckptool.ops.inspect.entry import SCHEMA as INSPECT_SCHEMA

    actual = {name: schema_name(name) for name in COMMANDS} | {"inspect": INSPECT_SCHEMA}
    named = [(page.name, m.group(0), m.group(1)) for page in _doc_pages()
             for m in re.finditer(r"ckptool\.([a-z-]+)/(\d+)", page.read_text(encoding="utf-8"))]
    assert any(name == "inspect" for _, _, name in named)
    wrong = [(page, schema) for page, schema, name in named if name in actual and actual[name] != schema]
    assert not wrong, f"schemas the commands do not print: {wrong}"
    # the versions differ between commands, so a sentence about all of them cannot name one
    generic = [page.name for page in _doc_pages() if re.search(r"ckptool\.<command>/\d", page.read_text("utf-8"))]
    assert not generic, f"one schema version named for every command: {generic}"


def test_the_architecture_table_has_one_home() -> None:
    """The layer table lives in docs/architecture.md; the README links it instead of keeping a copy that drifts."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    arch = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "| `ckptool/cli/` |" not in readme and "(docs/architecture.md)" in readme
    assert arch.count("| `ckptool/cli/` |") == 1


def test_the_readers_layer_is_drawn_and_summarised() -> None:
    """docs/architecture.md draws the readers layer and names every registered format and reader module; the README
    keeps a summary that links it and the format matrix, never a copy of the matrix."""
    from ckptool.readers import FORMATS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    arch = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    drawing = arch[arch.index("```text"):arch.index("```", arch.index("```text") + 7)]
    assert "ckptool/readers/" in drawing and "open_checkpoint" in drawing
    for name in FORMATS:
        assert name in drawing, name
    for module in sorted((ROOT / "ckptool" / "readers").glob("read_*.py")):
        assert module.stem in arch, module.stem
    assert "open_checkpoint" in readme and "(docs/formats.md)" in readme
    assert "| format | `inspect`" not in readme



# ------------------------------------------------------------------------------------------------ docs from the code
# docs/architecture.md describes the tree and docs/python-api.md the public API; both are held to the code here, so
# that a module moved or a name exported without its page fails a test instead of leaving the page stale.

_ARCH = ROOT / "docs" / "architecture.md"
_API = ROOT / "docs" / "python-api.md"


def _module_paths(text: str) -> set[str]:
    """The file and folder paths a page names: backticked tokens with a ``/`` or ending in ``.py`` (``model/graph.py``,
    ``ckptool/ops/scan/``, ``_fileio.py``), and ``ckptool/...`` paths anywhere (the drawing)."""
    found = {tok for tok in re.findall(r"`([\w./-]+)`", text) if "/" in tok or tok.endswith(".py")}
    found |= set(re.findall(r"(?<![\w/])ckptool/[\w/.]*[\w/]", text))
    return {tok for tok in found if not tok.startswith(("http", "."))}


def _exists(token: str) -> bool:
    """A path resolves from the repository root, from ``ckptool/``, or as the tail of a path inside ``ckptool/``
    (``_errors.py`` in the row of ``ckptool/cli/``)."""
    path = token.rstrip("/")
    if not token.endswith("/") and "." not in Path(path).name and not (ROOT / path).is_dir():
        path += ".py"  # a module named without its suffix, as in the drawing: ckptool/_fileio
    if (ROOT / path).exists() or (ROOT / "ckptool" / path).exists():
        return True
    return any(p.as_posix().endswith("/" + path) for p in (ROOT / "ckptool").rglob(Path(path).name))


#: dotted names that are not Python: the safetensors ``__metadata__`` key that records tied tensors
_NOT_MODULES = {"ckptool.shared"}


def _dotted_names(text: str) -> set[str]:
    return set(re.findall(r"\bckptool(?:\.[A-Za-z_]\w*)+", text)) - _NOT_MODULES


def _resolves(dotted: str) -> bool:
    """``ckptool.a.b`` is a module (file or package), or a module followed by one name it defines at top level."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            rest = parts[n:]
            if not rest:
                return True
            defined = rf"^(?:def|class) {rest[0]}\b|^{rest[0]}\s*[:=]"
            return len(rest) == 1 and re.search(defined, source.read_text(encoding="utf-8"), re.M) is not None
    return False


def test_architecture_names_only_modules_that_exist() -> None:
    text = _ARCH.read_text(encoding="utf-8")
    paths = _module_paths(text)
    assert len(paths) > 20, paths  # the page names modules; the extraction found them
    missing = sorted(p for p in paths if not _exists(p))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    dotted = _dotted_names(text)
    assert "ckptool.formats.tensors.Tensor" in dotted
    unresolved = sorted(d for d in dotted if not _resolves(d))
    assert not unresolved, f"docs/architecture.md names modules or names that do not exist: {unresolved}"


def test_architecture_names_every_subpackage() -> None:
    """Every package directly in ``ckptool/`` and in ``ckptool/ops/`` is named (``ckptool/ops/scan/``)."""
    text = _ARCH.read_text(encoding="utf-8")
    packages = [p.parent.relative_to(ROOT).as_posix() for folder in (ROOT / "ckptool", ROOT / "ckptool" / "ops")
                for p in folder.glob("*/__init__.py")]
    assert "ckptool/ops/inspect" in packages and "ckptool/readers" in packages
    unnamed = sorted(p for p in packages if f"{p}/" not in text)
    assert not unnamed, f"subpackages docs/architecture.md does not describe: {unnamed}"


def test_the_architecture_checks_catch_a_stale_page() -> None:
    assert not _exists("ops/inspect_torch.py") and not _exists("ckptool/ops/nowhere/")
    assert _exists("model/graph.py") and _exists("_errors.py") and _exists("ckptool/ops/scan/")
    assert _exists("ckptool/_fileio") and not _exists("ckptool/_nothing")
    assert _resolves("ckptool.readers") and _resolves("ckptool.formats.tensors.Storage")
    assert not _resolves("ckptool.readers.tensors") and not _resolves("ckptool.formats.tensors.Nothing")


def _api_sections() -> dict[str, str]:
    """docs/python-api.md's ``###`` sections: heading -> body."""
    text = _API.read_text(encoding="utf-8")
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return {parts[i].strip(): re.split(r"^##? ", parts[i + 1], flags=re.M)[0] for i in range(1, len(parts), 2)}


def test_python_api_has_a_section_and_an_example_for_every_public_name() -> None:
    import ckptool

    sections = _api_sections()
    headed = {name for heading in sections for name in re.findall(r"`(\w+)`", heading)}
    missing = sorted(set(ckptool.__all__) - headed)
    assert not missing, f"public names without a heading in docs/python-api.md: {missing}"
    unknown = sorted(headed - set(ckptool.__all__))
    assert not unknown, f"docs/python-api.md headings name what ckptool does not export: {unknown}"
    bare = [heading for heading, body in sections.items() if "```python" not in body]
    assert not bare, f"sections of docs/python-api.md without an example: {bare}"
    unused = _names_without_a_run_example(sections)
    assert not unused, f"public names that no executed example of their section uses: {unused}"


_PY_BLOCK = re.compile(r"(?:<!--\s*python:(?P<spec>[^\n]*?)-->\s*\n)?```python\n(?P<body>.*?)\n```", re.S)


def _names_without_a_run_example(sections: dict[str, str]) -> list[str]:
    """The names of the ``###`` headings whose section has no executed ``python`` block (one not excused with
    ``<!-- python: not run: ... -->``) that names them (a call, a type checked, a comment naming the result)."""
    missing = []
    for heading, body in sections.items():
        run = "\n".join(m.group("body") for m in _PY_BLOCK.finditer(body)
                        if not (m.group("spec") or "").strip().startswith("not run"))
        missing += [n for n in re.findall(r"`(\w+)`", heading) if not re.search(rf"\b{n}\b", run)]
    return missing


def test_an_example_that_is_not_run_does_not_count() -> None:
    """The check above fails for a name whose only example is excused from running, or does not use it."""
    excused = "<!-- python: not run: needs a server -->\n```python\nckptool.scan('x')\n```\n"
    assert _names_without_a_run_example({"`scan`": excused}) == ["scan"]
    assert _names_without_a_run_example({"`scan`, `ScanResult`": "```python\nckptool.scan('x')\n```\n"}) == \
        ["ScanResult"]
    assert _names_without_a_run_example({"`scan`": "```python\nckptool.scan('x')\n```\n"}) == []


def test_python_api_examples_run(tmp_path: Path) -> None:
    """Every ``python`` block of docs/python-api.md, in order, in one interpreter and one empty folder; a block
    after ``<!-- python: not run: WHY -->`` is excused."""
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    pytest.importorskip("jinja2")
    blocks = [m.group("body") for m in _PY_BLOCK.finditer(_API.read_text(encoding="utf-8"))
              if not (m.group("spec") or "").strip().startswith("not run")]
    assert len(blocks) >= 20
    script = "\n\n".join(blocks)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "error::DeprecationWarning:__main__"}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=False, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
