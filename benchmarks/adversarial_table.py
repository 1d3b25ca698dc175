"""The table of the adversarial corpus (``fuzz/adversarial_*.py``): for each class of trick and each command, what
the command did (refused: exit 2 or an ``Error:`` line; flagged: scan's dangerous / needs-trust / unreadable exit;
accepted: exit 0), whether the marker payload ran, and the worst wall time per class; the worst peak RSS per
class is measured for ``scan`` and ``inspect`` in a subprocess.

    python benchmarks/adversarial_table.py     # prints a Markdown table

Every run sets ``CKPTOOL_MARKER``; a payload that ran would create that file.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "fuzz"), str(ROOT / "tests"), str(ROOT)]

import adversarial  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from ckptool.cli import cli  # noqa: E402

COMMANDS = {
    "inspect": ["inspect", "PATH"], "scan": ["scan", "PATH"],
    "remap": ["remap", "PATH", "--to", "cpu", "-o", "OUT/r.pth"],
    "strip-dp": ["strip-dataparallel", "PATH", "-o", "OUT/s.pth"],
    "convert": ["convert", "PATH", "-o", "OUT/c.safetensors"],
    "diff": ["diff", "PATH", "PATH"], "sanitize": ["sanitize", "PATH", "-o", "OUT/z.pth"],
    "extract": ["extract-state-dict", "PATH", "-o", "OUT/e.pth"],
    "rename": ["rename", "PATH", "--rule", "^=x.", "--allow-unused", "-o", "OUT/n.pth"],
    "report": ["report", "PATH", "-o", "OUT/p.html"],
}


def outcome(command: str, code: int) -> str:
    if code == 0:
        return "accepted"
    if command == "scan" and code in (1, 4):
        return "flagged"
    return "refused"


#: measures one child from a small interpreter: a child forked from this process (torch loaded) would count this
#: process's pages in its ru_maxrss
_TRAMPOLINE = """
import os, subprocess, sys, time
t = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, _, u = os.wait4(p.pid, 0)
print(time.perf_counter() - t, u.ru_maxrss / 1024)
"""


def peak_rss(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one ``python -m ckptool ARGS`` process (``os.wait4`` in a small parent:
    the child's own rusage)."""
    out = subprocess.run([sys.executable, "-c", _TRAMPOLINE, sys.executable, "-m", "ckptool", *args], env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        made = adversarial.write(root / "corpus")
        marker = root / "marker"
        os.environ[adversarial.MARKER_ENV] = str(marker)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        table: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        worst: dict[str, float] = defaultdict(float)
        rss: dict[str, float] = defaultdict(float)
        ran = 0
        for case, path in made:
            for name, template in COMMANDS.items():
                out = root / "out" / case.name / name
                out.mkdir(parents=True)
                args = [a.replace("PATH", str(path)).replace("OUT", str(out)) for a in template]
                start = time.perf_counter()
                res = CliRunner().invoke(cli, args)
                worst[case.klass] = max(worst[case.klass], time.perf_counter() - start)
                table[case.klass][name].add(outcome(name, res.exit_code))
                if marker.exists():
                    ran += 1
                    marker.unlink()
            for name in ("scan", "inspect"):
                took, peak = peak_rss([name, str(path)], env)
                worst[case.klass] = max(worst[case.klass], took)
                rss[case.klass] = max(rss[case.klass], peak)
    cols = list(COMMANDS)
    print(f"payloads run: {ran}")
    header = ["class", *cols, "worst s", "RSS MiB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for klass, row in table.items():
        cells = ["/".join(sorted(row[c])) for c in cols]
        print(f"| {klass} | " + " | ".join(cells) + f" | {worst[klass]:.2f} | {rss[klass]:.0f} |")


if __name__ == "__main__":
    main()
