"""Fuzz the readers (bounded, for CI): mutants of the real, generated and hostile files make ``inspect``,
``read_checkpoint``, ``read_pickle_file``, ``scan_file``, ``load_structure`` and ``extract_state_dict`` raise
only :class:`ckptool.errors.CkptError`, never another exception, and never hang.

Hypothesis picks the seed file and the mutations, so a failure shrinks to a small reproducer. The number of
cases is ``CKPTOOL_FUZZ_EXAMPLES`` per test (default 1500: about 3,000 cases, well under a minute on 2 cores);
runs are derandomized (the same cases every time) unless ``CKPTOOL_FUZZ_RANDOM=1``. The long run::

    CKPTOOL_FUZZ_EXAMPLES=100000 CKPTOOL_FUZZ_RANDOM=1 python -m pytest tests/test_fuzz.py
    python fuzz/fuzz_readers.py --seconds 3600          # plain random mutation, no hypothesis
    python fuzz/atheris_target.py fuzz-corpus/          # coverage-guided (pip install atheris)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptool.errors import CkptError
from ckptool.formats.unpickler import load_structure

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import fuzz_readers

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

EXAMPLES = int(os.environ.get("CKPTOOL_FUZZ_EXAMPLES", "1500"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, database=None, derandomize=not os.environ.get("CKPTOOL_FUZZ_RANDOM"),
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def seeds(generated: dict[str, Path]) -> list[bytes]:
    out = fuzz_readers.load_seeds(include_generated=False)
    out += [p.read_bytes() for p in generated.values() if p.stat().st_size < (1 << 20)]
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_fuzz_readers_on_mutated_files(seeds: list[bytes], workdir: Path) -> None:
    path = str(workdir / "mutant.pt")

    @FUZZ_SETTINGS
    @given(which=st.integers(0, len(seeds) - 1), rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 8))
    def run(which: int, rng_seed: int, rounds: int) -> None:
        data = fuzz_readers.mutate(seeds[which], random.Random(rng_seed), seeds, rounds)
        with open(path, "wb") as f:
            f.write(data)
        fuzz_readers.check_file(path, timeout=10)

    run()


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.frozensets(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@FUZZ_SETTINGS
@given(obj=_values, protocol=st.integers(0, 5), rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 6))
def test_fuzz_unpickler_on_mutated_pickles(obj: object, protocol: int, rng_seed: int, rounds: int) -> None:
    """Mutated pickles of random values, all protocols: the restricted unpickler raises only CkptError."""
    data = fuzz_readers.mutate(pickle.dumps(obj, protocol=protocol), random.Random(rng_seed), rounds=rounds)
    with contextlib.suppress(CkptError):
        load_structure(data)


def test_mutate_is_deterministic() -> None:
    a = fuzz_readers.mutate(b"\x80\x02}q\x00.", random.Random(5), rounds=5)
    assert a == fuzz_readers.mutate(b"\x80\x02}q\x00.", random.Random(5), rounds=5)
