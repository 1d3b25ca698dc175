"""Issue 37, items 6 to 9: the right install named for numpy, messages that name what they mean (sanitize's
dangerous global, a read-only folder, plurals, one "re-tagged"), readable results in Python, the demo's fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NUMPY_HINT = ("Error: this needs the numpy package, which is not installed (`pip install ckptool` leaves it out); "
              "install it with: pip install 'ckptool[numpy]'")


# ------------------------------------------------------------------------------------------ 6. numpy
@pytest.mark.torchfree
def test_a_missing_numpy_names_the_numpy_extra() -> None:
    from ckptool.cli._errors import describe_error

    numpy = ModuleNotFoundError("No module named 'numpy'", name="numpy")
    assert describe_error(numpy) == (NUMPY_HINT.removeprefix("Error: "), 1)
    torch = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert describe_error(torch)[0].endswith("pip install 'ckptool[torch]'")


def test_the_numpy_extra_exists() -> None:
    import tomllib

    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["numpy"] == ["numpy"] and "numpy" in extras["torch"]


@pytest.mark.torchfree
@pytest.mark.parametrize("args", [
    ["average", "{g}/sd_cpu.pt", "{g}/sd_cpu.pt", "-o", "{o}/avg.pt"],
    ["report", "{g}/sd_cpu.pt", "{g}/sd_cpu.pt", "-o", "{o}/r.html"],
    ["diff", "{g}/sd_cpu.pt", "{g}/sd_cpu.pt", "--atol", "0.1"],
])
def test_commands_that_need_numpy_name_the_numpy_extra(generated: dict[str, Path], tmp_path: Path,
                                                       args: list[str]) -> None:
    """Run where neither torch nor numpy imports (``sys.modules[name] = None`` in the child, before ckptool
    starts): the one line names ``ckptool[numpy]``, not the 245 MB torch extra."""
    g = next(iter(generated.values())).parent
    code = ("import sys; sys.modules['torch'] = sys.modules['numpy'] = None; from ckptool.cli import main; "
            "sys.argv = ['ckptool', *sys.argv[1:]]; main()")
    env = {k: v for k, v in os.environ.items() if k != "CKPTOOL_DEBUG"}
    p = subprocess.run([sys.executable, "-c", code, *[a.format(g=g, o=tmp_path) for a in args]], check=False,
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (p.returncode, p.stderr.splitlines()) == (1, [NUMPY_HINT])
