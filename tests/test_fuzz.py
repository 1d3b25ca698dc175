"""Fuzz the readers (bounded, for CI): mutants of the real, generated and hostile files, and structure-aware
variants of safetensors headers, sharded-set indexes, DCP ``.metadata`` pickles, deflated zip members and pickle
streams, make every reader (``inspect``, ``read_checkpoint``, ``read_pickle_file``, ``scan_file``,
``load_structure``, the safetensors header, ``read_index``, ``read_dcp_metadata``, ``remap``, ``convert``, ``diff``,
``extract_state_dict``, the zip member inflater and the pickle opcode walkers) raise only
:class:`ckptool.errors.CkptError`, never another exception, and never hang.

Hypothesis picks the seed file and the mutations, so a failure shrinks to a small reproducer; each failure found
becomes a case of ``fuzz/regressions.py`` (run by ``test_fuzz_regressions``). The number of cases is
``CKPTOOL_FUZZ_EXAMPLES`` for the file fuzzer (default 1500) and a fifth of it, at least 100, for the others (about
4,500 cases in all, about a minute on 2 cores); runs are derandomized (the same cases every time) unless
``CKPTOOL_FUZZ_RANDOM=1``. The long run::

    CKPTOOL_FUZZ_EXAMPLES=100000 CKPTOOL_FUZZ_RANDOM=1 python -m pytest tests/test_fuzz.py
    python fuzz/fuzz_readers.py --seconds 3600          # plain random mutation, no hypothesis
    python fuzz/atheris_target.py fuzz-corpus/          # coverage-guided (pip install atheris)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import struct
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptool.errors import CkptError, CorruptCheckpointError
from ckptool.formats import pickle_check, zipdir
from ckptool.formats.pickle_check import check_pickle, walk_prefix
from ckptool.formats.unpickler import load_structure

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import fuzz_readers
import regressions

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

EXAMPLES = int(os.environ.get("CKPTOOL_FUZZ_EXAMPLES", "1500"))
SMALL = max(100, EXAMPLES // 5)
_COMMON = {"deadline": None, "database": None, "derandomize": not os.environ.get("CKPTOOL_FUZZ_RANDOM"),
           "suppress_health_check": list(HealthCheck)}
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, **_COMMON)
SMALL_SETTINGS = settings(max_examples=SMALL, **_COMMON)
#: cases run per test (printed at the end with ``-s``; the report quotes them)
CASES: Counter[str] = Counter()


_DIRS: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def _fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A folder for the module-level hypothesis tests; at the end, the number of cases run (seen with ``-s``)."""
    _DIRS["root"] = tmp_path_factory.mktemp("fuzz-structured")
    yield
    sys.stderr.write(f"\nfuzz cases: {dict(CASES)} = {sum(CASES.values())}\n")


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
    which = fuzz_readers.readers()

    @FUZZ_SETTINGS
    @given(which_seed=st.integers(0, len(seeds) - 1), rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 8))
    def run(which_seed: int, rng_seed: int, rounds: int) -> None:
        CASES["files"] += 1
        data = fuzz_readers.mutate(seeds[which_seed], random.Random(rng_seed), seeds, rounds)
        with open(path, "wb") as f:
            f.write(data)
        fuzz_readers.check_file(path, timeout=10, which=which)

    run()
    assert CASES["files"] >= min(EXAMPLES, 100)


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.frozensets(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@FUZZ_SETTINGS
@given(obj=_values, protocol=st.integers(0, 5), rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 6),
       cut=st.integers(1, 64))
def test_fuzz_unpickler_on_mutated_pickles(obj: object, protocol: int, rng_seed: int, rounds: int, cut: int) -> None:
    """Mutated pickles of random values, all protocols: the restricted unpickler raises only CkptError, and the
    streaming opcode walk (as a deflated data.pkl arrives, ``cut`` bytes at a time) finds the STOP opcode the
    whole-buffer check finds, or refuses what it refuses."""
    CASES["pickles"] += 1
    data = fuzz_readers.mutate(pickle.dumps(obj, protocol=protocol), random.Random(rng_seed), rounds=rounds)
    with contextlib.suppress(CkptError):
        load_structure(data)
    try:
        whole: int | None = check_pickle(data, exact=False, strict_frames=False)
    except CorruptCheckpointError:
        whole = None
    buf = bytearray()
    pos, end = 0, None
    try:
        for i in range(0, len(data), cut):
            buf += data[i:i + cut]
            r = walk_prefix(buf, 0, pos)
            if r >= 0:
                end = r
                break
            pos = ~r
    except CorruptCheckpointError:
        assert whole is None  # refused as it arrived: the whole-buffer check refuses it too
        return
    assert end == whole


def _walked(data: bytes, *, linear: bool, exact: bool) -> tuple[object, str | None]:
    """:func:`check_pickle` of ``data`` with every opcode run matched by RE2 (``linear``) or by ``re`` (from the
    first opcode in both cases): where it ends, or the error it raises, and the weights_only verdict."""
    saved = pickle_check.LINEAR_FROM, pickle_check._FAST_FROM_START, pickle_check._PY_PREFIX
    pickle_check.LINEAR_FROM = 0 if linear else 1 << 62
    pickle_check._FAST_FROM_START = pickle_check._PY_PREFIX = 0
    wo: list[str | None] = [None]
    try:
        return check_pickle(data, exact=exact, weights_only=wo), wo[0]
    except CorruptCheckpointError as e:
        return f"{type(e).__name__}: {e}", None
    finally:
        pickle_check.LINEAR_FROM, pickle_check._FAST_FROM_START, pickle_check._PY_PREFIX = saved


@FUZZ_SETTINGS
@given(obj=_values, protocol=st.integers(0, 5), rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(0, 6),
       exact=st.booleans())
def test_fuzz_re2_and_re_walk_pickles_alike(obj: object, protocol: int, rng_seed: int, rounds: int,
                                            exact: bool) -> None:
    """The opcode walk of a large pickle runs on RE2 (issue 41: about 6x faster than ``re``): on mutated pickles of
    random values, all protocols, both engines end at the same STOP opcode, refuse with the same words and give the
    same weights_only verdict."""
    CASES["re2"] += 1
    data = pickle.dumps(obj, protocol=protocol)
    data = fuzz_readers.mutate(data, random.Random(rng_seed), rounds=rounds) if rounds else data
    assert _walked(data, linear=True, exact=exact) == _walked(data, linear=False, exact=exact)


def test_re2_walks_a_torch_sized_pickle_as_re_does() -> None:
    """A pickle past :data:`LINEAR_FROM` as torch writes a state_dict (protocol 2, memo puts, short strings, the
    persistent ids of 20,000 storages) is walked by RE2 by default, to the offset ``re`` finds."""
    rows = {f"layer.{i}.weight": ("storage", f"{i}", "cpu", i * 7, (i % 5, 3), (3, 1), 1.5) for i in range(20_000)}
    data = pickle.dumps(rows, protocol=2)
    assert len(data) >= pickle_check.LINEAR_FROM
    pickle_check._linear.clear()
    assert check_pickle(data) == len(data) == _walked(data, linear=False, exact=True)[0]
    assert pickle_check._linear  # RE2 compiled for this walk


# ------------------------------------------------------------------------------------------------ safetensors headers
_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 1 << 66) | st.floats(allow_nan=False)
                     | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "BOOL", "F8_E4M3", "F4", "C64", "Q9", ""]) | _json,
    "shape": st.lists(st.integers(-2, 1 << 64), max_size=4) | _json,
    "data_offsets": st.lists(st.integers(-2, 80), min_size=2, max_size=2) | _json,
})


@SMALL_SETTINGS
@given(entries=st.dictionaries(st.text(max_size=6), _entry | _json, max_size=4), meta=_json, pad=st.binary(max_size=80))
def test_fuzz_safetensors_headers(entries: dict[str, Any], meta: Any, pad: bytes) -> None:
    """Structure-aware safetensors headers (right keys, wild values): every reader raises only CkptError."""
    CASES["safetensors headers"] += 1
    doc = dict(entries)
    if meta is not None:
        doc["__metadata__"] = meta
    raw = json.dumps(doc).encode()
    path = _DIRS["root"] / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + pad)
    fuzz_readers.check_file(str(path), timeout=10, which=_ST_READERS)


# ------------------------------------------------------------------------------------------------ sharded indexes
_SHARDS = {"model-00001-of-00002.safetensors": {"a": 2, "b": 3}, "model-00002-of-00002.safetensors": {"c": 1}}
_shard_name = st.sampled_from([*_SHARDS, "", ".", "..", "../x", "/etc/passwd", "nope.safetensors", "a\x00b"])


@SMALL_SETTINGS
@given(weight_map=st.dictionaries(st.sampled_from(["a", "b", "c", "d", ""]) | st.text(max_size=4),
                                  _shard_name | _json, max_size=5),
       meta=_json, rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(0, 3))
def test_fuzz_sharded_index(weight_map: dict[str, Any], meta: Any, rng_seed: int, rounds: int) -> None:
    """Sharded-set indexes naming real, missing, escaping or odd shard files, with wild metadata, some
    byte-mutated: inspect, read_index and diff raise only CkptError."""
    CASES["sharded indexes"] += 1
    folder = _DIRS["root"] / "set"
    if not folder.exists():
        folder.mkdir()
        for name, tensors in _SHARDS.items():
            (folder / name).write_bytes(regressions.safetensors_bytes(tensors))
    raw = json.dumps({"metadata": meta, "weight_map": weight_map}).encode()
    if rounds:
        raw = fuzz_readers.mutate(raw, random.Random(rng_seed), rounds=rounds)
    index = folder / "model.safetensors.index.json"
    index.write_bytes(raw)
    fuzz_readers.check_file(str(index), timeout=10, which=_SET_READERS)


# ------------------------------------------------------------------------------------------------ DCP metadata
@pytest.fixture(scope="module")
def dcp_metadata(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The ``.metadata`` pickle of a real ``dcp.save`` (a state_dict, an optimizer state and a plain value)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp = tmp_path_factory.mktemp("dcp")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    try:
        dcp.save({"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}, "step": 7, "name": "run"},
                 checkpoint_id=str(tmp / "ckpt"))
    finally:
        dist.destroy_process_group()
    return (tmp / "ckpt" / ".metadata").read_bytes()


def test_fuzz_dcp_metadata(dcp_metadata: bytes) -> None:
    """Mutants of a real DCP ``.metadata`` pickle in a DCP folder: inspect, read_dcp_metadata and diff raise only
    CkptError."""
    folder = _DIRS["root"] / "dcp"
    folder.mkdir(exist_ok=True)
    (folder / "__0_0.distcp").write_bytes(bytes(64))

    @SMALL_SETTINGS
    @given(rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 6))
    def run(rng_seed: int, rounds: int) -> None:
        CASES["dcp metadata"] += 1
        (folder / ".metadata").write_bytes(fuzz_readers.mutate(dcp_metadata, random.Random(rng_seed), rounds=rounds))
        fuzz_readers.check_file(str(folder), timeout=10, which=_SET_READERS)

    run()


# ------------------------------------------------------------------------------------------------ zip members
@SMALL_SETTINGS
@given(content=st.binary(max_size=3000) | st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=4),
                                                   st.integers(1, 200_000)),
       declared_delta=st.integers(-5, 5) | st.sampled_from([1 << 31, -(1 << 20)]), crc_ok=st.booleans(),
       cut=st.integers(0, 8), method=st.sampled_from([8, 8, 8, 0, 12]), level=st.integers(0, 9))
def test_fuzz_member_buffer(content: bytes, declared_delta: int, crc_ok: bool, cut: int, method: int,
                            level: int) -> None:
    """Deflated (or stored) members with lying sizes, bad CRCs and cut streams: ``member_buffer`` returns exactly
    the declared content or raises CorruptCheckpointError, inflating no more than the declared size."""
    CASES["zip members"] += 1
    co = zlib.compressobj(level, zlib.DEFLATED, -15)
    body = co.compress(content) + co.flush() if method == 8 else content
    cut = min(cut, len(body))  # cutting an empty stored body leaves it whole (and valid)
    body = body[:len(body) - cut] if cut else body
    declared = max(0, len(content) + declared_delta)
    crc = zlib.crc32(content) if crc_ok else zlib.crc32(content) ^ 1
    data = b"PK\x03\x04" + bytes(26) + body
    entry = zipdir.ZipEntry("x", 0, len(body), declared, crc, method, 0)
    f = io.BytesIO(data)
    try:
        out = zipdir.member_buffer(f, entry, "fuzz", watch=lambda b: None)
    except CorruptCheckpointError:
        return
    assert bytes(out) == content and len(content) == declared and crc_ok and cut == 0


# ------------------------------------------------------------------------------------------------ regressions
@pytest.mark.parametrize("case", regressions.CASES, ids=[c.name for c in regressions.CASES])
def test_fuzz_regressions(case: regressions.Case, workdir: Path) -> None:
    """Every crash the fuzzers found, as a fixture: now a CkptError (or a clean read)."""
    case.check(workdir, fuzz_readers)


def test_mutate_is_deterministic() -> None:
    a = fuzz_readers.mutate(b"\x80\x02}q\x00.", random.Random(5), rounds=5)
    assert a == fuzz_readers.mutate(b"\x80\x02}q\x00.", random.Random(5), rounds=5)


# state the module-level hypothesis tests share (hypothesis does not mix with function-scoped fixtures)
_ST_READERS = [r for r in fuzz_readers.readers() if r[0] in ("inspect", "safetensors_header", "convert", "diff",
                                                               "scan_file")]
_SET_READERS = fuzz_readers.set_readers()


def _prefix_walked(data: bytes, *, warm: bool, exact: bool, with_wo: bool = True) -> tuple[object, ...]:
    """:func:`check_pickle` of ``data`` as a scan of many small files walks it (``warm``: the first bytes matched by
    :func:`pickle_check._prefix_pattern`) or as the first walks of a process do (every opcode of the first bytes
    checked in Python): where it ends or the error it raises (with its offset), the weights_only verdict (asked for
    ``with_wo``: the walk then starts with the weights_only expression), the blobs and FRAMEs and the gaps."""
    saved = pickle_check.PREFIX_COMPILE_AFTER, pickle_check._PY_PREFIX
    pickle_check.PREFIX_COMPILE_AFTER = -1 if warm else 1 << 62
    pickle_check._PY_PREFIX = max(16, len(data) // 2)  # a prefix, then the fast expression, as in a large pickle
    wo: list[str | None] = [None]
    blobs: list[pickle_check.Span] = []
    gaps: list[tuple[bytes, bytes]] = []
    try:
        got: object = check_pickle(data, exact=exact, weights_only=wo if with_wo else None, blobs=blobs, gaps=gaps)
    except CorruptCheckpointError as e:
        got = (f"{type(e).__name__}: {e}", e.offset)  # type: ignore[attr-defined]
    finally:
        pickle_check.PREFIX_COMPILE_AFTER, pickle_check._PY_PREFIX = saved
    return got, wo[0], blobs, gaps


@FUZZ_SETTINGS
@given(obj=_values, protocol=st.integers(0, 5), rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(0, 6),
       exact=st.booleans(), memo=st.sampled_from([b"", b"r\x05\x00\x00\x00", b"p7\n", b"r\x00\x00\x01\x00"]),
       with_wo=st.booleans())
def test_fuzz_prefix_expression_walks_as_python(obj: object, protocol: int, rng_seed: int, rounds: int,
                                                exact: bool, memo: bytes, with_wo: bool) -> None:
    """A scan of many small pickles walks their first bytes with :func:`pickle_check._prefix_pattern` once
    :data:`~ckptool.formats.pickle_check.PREFIX_COMPILE_AFTER` walks were made (issue 52): on mutated pickles of
    random values, all protocols, with memo puts whose index no pickler could have written at their offset, it
    ends at the same STOP opcode as the walk in Python, refuses with the same words at the same offset, and finds
    the same weights_only verdict, blobs, FRAMEs and gaps."""
    CASES["prefix"] += 1
    data = pickle.dumps(obj, protocol=protocol)
    data = data[:2] + memo + data[2:] if memo and protocol else data
    data = fuzz_readers.mutate(data, random.Random(rng_seed), rounds=rounds) if rounds else data
    warm = _prefix_walked(data, warm=True, exact=exact, with_wo=with_wo)
    assert warm == _prefix_walked(data, warm=False, exact=exact, with_wo=with_wo)


def test_prefix_expression_refuses_a_memo_bomb_in_the_first_bytes() -> None:
    """The prefix expression leaves memo puts to the check in Python: an index above the offset of a small
    pickle's LONG_BINPUT or PUT is refused by a warm walk too (the expression of large pickles would accept an
    index below 2**16)."""
    for put in (b"r\x00\x10\x00\x00", b"p4096\n"):
        for with_wo in (True, False):
            data = b"\x80\x02" + b"N" + put + b"."
            warm = _prefix_walked(data, warm=True, exact=True, with_wo=with_wo)
            assert warm == _prefix_walked(data, warm=False, exact=True, with_wo=with_wo)
            assert "memo index 4096" in str(warm[0])


def test_prefix_expression_is_compiled_after_many_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first walks of a process check the first bytes in Python (compiling the expression would cost more
    than a few small pickles); after PREFIX_COMPILE_AFTER walks the expression is compiled once and used."""
    monkeypatch.setattr(pickle_check, "_prefix_walks", [0])
    monkeypatch.setattr(pickle_check, "_prefix_patterns", {})
    data = pickle.dumps({"step": 1, "name": "x" * 20}, protocol=4)
    for _ in range(pickle_check.PREFIX_COMPILE_AFTER):
        assert check_pickle(data) == len(data)
    assert pickle_check._prefix_patterns == {}
    assert check_pickle(data) == len(data)
    assert list(pickle_check._prefix_patterns) == [False]
