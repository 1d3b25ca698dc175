"""Fuzz ckptool's readers: mutate real and generated checkpoints, and check that reading them only ever raises
ckptool's own error type (:class:`ckptool.errors.CkptError`), never another exception, a hang or a crash.

The bounded run is ``tests/test_fuzz.py`` (hypothesis picks seeds and mutations, a few thousand cases in CI).
This script is the long run, with nothing but the standard library::

    python fuzz/fuzz_readers.py --seconds 3600 --out fuzz-crashes/      # random mutations for an hour
    python fuzz/fuzz_readers.py --iterations 100000 --seed 7

It seeds from ``fixtures/real``, the generated fixtures (``fixtures/make_fixtures.py``, needs torch) and the
hostile corpus (``fuzz/hostile_corpus.py``), mutates them (bit flips, interesting integers, truncation,
deletion, duplication, splicing of other seeds), and runs each mutant through ``inspect``, ``read_checkpoint``,
``read_pickle_file``, ``scan_file``, ``load_structure`` and ``extract_state_dict``. Each failing input is saved
in ``--out`` with the traceback; a reader that runs longer than ``--timeout`` seconds counts as a hang.
For coverage-guided fuzzing see ``fuzz/atheris_target.py``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE), str(REPO / "fixtures")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
#: bytes that make a mutant more interesting to a pickle reader: opcodes with arguments, headers
TOKENS = [b"\x80\x02", b"\x80\x05\x95", b"r\xff\xff\xff\x7f", b"p99999999\n", b"\x8d\xff\xff\xff\xff\xff\xff\xff\x7f",
          b"cos\nsystem\n", b"\x8c\x02os\x94\x8c\x06system\x94\x93", b"(", b")", b"\x85" * 64, b"]" * 64, b"t",
          b"R", b"Q", b"b", b"u", b"s", b".", b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06",
          b"PK\x06\x07", b"\xff\xff\xff\xff", b"X\xff\xff\xff\x7f"]


def mutate(data: bytes, rng: random.Random, others: Sequence[bytes] = (), rounds: int | None = None) -> bytes:
    """``data`` with 1-8 random mutations (the same ``rng`` state gives the same result)."""
    b = bytearray(data)
    for _ in range(rounds if rounds is not None else rng.randint(1, 8)):
        op = rng.randrange(9)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip a bit
            i = min(pos, len(b) - 1)
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # a random byte
            b[min(pos, len(b) - 1)] = rng.randrange(256)
        elif op == 2:  # an interesting integer, 1/2/4/8 bytes little-endian
            width = rng.choice((1, 2, 4, 8))
            v = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
            b[pos:pos + width] = v.to_bytes(width, "little")
        elif op == 3:  # truncate
            del b[pos:]
        elif op == 4:  # delete a range
            del b[pos:pos + rng.randint(1, 64)]
        elif op == 5:  # insert random bytes
            b[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 6 and b:  # duplicate a chunk
            a = rng.randrange(len(b))
            b[pos:pos] = b[a:a + rng.randint(1, 256)]
        elif op == 7:  # a token
            b[pos:pos] = rng.choice(TOKENS)
        elif op == 8 and others:  # splice in part of another seed
            o = rng.choice(others)
            if o:
                a = rng.randrange(len(o))
                b[pos:pos + rng.randint(0, 64)] = o[a:a + rng.randint(1, 4096)]
    return bytes(b)


def load_seeds(include_generated: bool = True, max_size: int = 4 << 20) -> list[bytes]:
    """The seed files' bytes: real fixtures, generated fixtures (if torch is available), the hostile corpus."""
    out = [p.read_bytes() for p in sorted((REPO / "fixtures" / "real").iterdir()) if p.suffix != ".md"]
    if include_generated:
        try:
            import make_fixtures  # needs torch

            with tempfile.TemporaryDirectory() as d:
                out += [p.read_bytes() for p in make_fixtures.build_all(Path(d)).values()]
        except ImportError:
            pass
    import hostile_corpus

    out += [e.data for e in hostile_corpus.build() if len(e.data) < (1 << 20)]
    return [s for s in out if len(s) <= max_size]


def readers() -> list[tuple[str, Callable[[str], object]]]:
    """``(name, function(path))`` for every reader of a single file under test: the format readers, inspect and
    scan, and the commands that read then rewrite (remap, convert to safetensors, diff, extract-state-dict)."""
    from ckptool.formats.safetensors import read_header
    from ckptool.formats.torchfile import read_checkpoint, read_pickle_file
    from ckptool.formats.unpickler import load_structure
    from ckptool.ops.convert import convert
    from ckptool.ops.diff.compare import diff
    from ckptool.ops.inspect.entry import inspect
    from ckptool.ops.rewrite.remap import remap
    from ckptool.scanning.entry import scan_file

    def structure(path: str) -> object:
        with open(path, "rb") as f:
            return load_structure(f.read(), "fuzzed pickle")

    out: list[tuple[str, Callable[[str], object]]] = [
        ("inspect", inspect), ("read_checkpoint", read_checkpoint), ("read_pickle_file", read_pickle_file),
        ("scan_file", scan_file), ("load_structure", structure), ("safetensors_header", read_header),
        ("remap", lambda path: remap(path, path + OUT_SUFFIXES[0], to="cpu")),
        ("convert", lambda path: convert(path, path + OUT_SUFFIXES[1], verify=False)),
        ("diff", lambda path: diff(path, path)),
    ]
    try:
        from ckptool.ops.extract import extract_state_dict

        def extract(path: str) -> object:
            return extract_state_dict(path, path + OUT_SUFFIXES[2], quiet=True)

        out.append(("extract_state_dict", extract))
    except ImportError:
        pass
    return out


#: what the rewriting readers write beside the fuzzed file (removed after each)
OUT_SUFFIXES = (".remap.pt", ".out.safetensors", ".sd.pth")


def set_readers() -> list[tuple[str, Callable[[str], object]]]:
    """``(name, function(path))`` for the readers of a sharded set's ``*.index.json`` or a DCP folder."""
    from ckptool.formats.dcp import read_dcp_metadata
    from ckptool.formats.sharded import read_index
    from ckptool.ops.diff.compare import diff
    from ckptool.ops.inspect.entry import inspect

    def index(path: str) -> object:
        return read_index(path) if path.endswith(".json") else read_dcp_metadata(path)

    return [("inspect", inspect), ("index", index), ("diff", lambda path: diff(path, path))]


class ReaderBug(AssertionError):
    """A reader raised something other than a CkptError, or took too long."""


def check_file(path: str, timeout: float = 10.0, which: list[tuple[str, Callable[[str], object]]] | None = None
               ) -> None:
    """Run every reader (``which``, default :func:`readers`) on ``path``.

    Raises:
        ReaderBug: a reader raised an exception that is not a CkptError, or ran longer than ``timeout`` seconds.
    """
    from ckptool.errors import CkptError

    for name, fn in which if which is not None else readers():
        t = time.perf_counter()
        try:
            fn(path)
        except CkptError:
            pass
        except Exception as e:  # the point: nothing else may escape
            raise ReaderBug(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}") from e
        finally:
            for suffix in OUT_SUFFIXES:
                if os.path.exists(path + suffix):
                    os.unlink(path + suffix)
        took = time.perf_counter() - t
        if took > timeout:
            raise ReaderBug(f"{name} took {took:.1f} s (a hang?)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="stop after this long (default 60)")
    ap.add_argument("--iterations", type=int, default=0, help="stop after this many mutants (0: no limit)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds one reader may take (default 10)")
    ap.add_argument("--out", type=Path, default=Path("fuzz-crashes"), help="folder for failing inputs")
    ap.add_argument("--no-generated", action="store_true", help="do not build the generated fixtures (no torch)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    rng = random.Random(seed)
    seeds = load_seeds(include_generated=not args.no_generated)
    print(f"seed {seed}, {len(seeds)} seed files", flush=True)
    start = time.monotonic()
    n = failures = 0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mutant.pt")
        while time.monotonic() - start < args.seconds and (not args.iterations or n < args.iterations):
            data = mutate(rng.choice(seeds), rng, seeds)
            with open(path, "wb") as f:
                f.write(data)
            try:
                check_file(path, args.timeout)
            except ReaderBug as e:
                failures += 1
                args.out.mkdir(parents=True, exist_ok=True)
                name = args.out / f"crash-{seed}-{n}"
                name.with_suffix(".pt").write_bytes(data)
                name.with_suffix(".txt").write_text(str(e))
                print(f"FAIL {name}.pt: {str(e).splitlines()[0]}", flush=True)
            n += 1
            if n % 1000 == 0:
                print(f"{n} mutants, {failures} failures, {time.monotonic() - start:.0f} s", flush=True)
    print(f"done: {n} mutants, {failures} failures (seed {seed})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["OUT_SUFFIXES", "ReaderBug", "check_file", "load_seeds", "main", "mutate", "readers", "set_readers"]
