"""What scanning one remote object costs (issue 38): the opens of one scan share one ``HEAD`` and the ranges
fetched (:func:`ckptool._source.object_reads`, :class:`ckptool._ranges.RangeStore`), counted on the HTTP server of
``remote_servers.py``; and the range store itself, against the bytes it stands for.

The checkpoint is a zip laid out as torch writes one (``archive/data.pkl`` first, then an 8 MB record), made here
with :mod:`zipfile` (no torch): a scan reads its first block, its end record and directory, and its pickle.
"""

from __future__ import annotations

import io
import itertools
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptool import _source
from ckptool._ranges import RangeStore
from ckptool._remote import BLOCK

pytestmark = pytest.mark.torchfree

SIZE = 8 << 20


def _zip(path: Path) -> int:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"step": 3, "lr": [0.1] * 50}, protocol=2))
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/data/0", b"\x00" * SIZE)
        z.writestr("archive/version", b"3\n")
    path.write_bytes(buf.getvalue())
    return len(buf.getvalue())


@pytest.fixture
def served(request: pytest.FixtureRequest) -> tuple[Any, str, int]:
    """The HTTP server, the URL of a zip of 8 MB on it (its own name) and its size."""
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    from remote_servers import url

    http = request.getfixturevalue("http")
    name = f"ranges-{request.node.name.replace('[', '-').rstrip(']')}.pt"
    size = _zip(http.root / name)
    return http, url(http, name), size


def _requests(http: Any, u: str) -> list[tuple[str, str, str]]:
    path = "/" + u.split("/", 3)[3]
    return [r for r in http.log if r[1] == path]


@pytest.mark.parametrize("listed", [False, True])
def test_one_object_is_one_head_and_a_few_ranges(served: tuple[Any, str, int], listed: bool) -> None:
    """A scan opens the object several times (format check, zip directory, pickle walk, code finder; a listed
    object without a checkpoint's name first has its first bytes looked at): one ``HEAD`` in all, and no range
    twice. Before the store each open asked its own ``HEAD`` (6 in all) and fetched its own ranges (10 reads,
    400 KB of this 8 MB file)."""
    from ckptool.ops.scan.many import Target, scan_target

    http, u, size = served
    before, sent = len(http.log), http.sent
    res = scan_target(Target(u, listed=listed))
    assert res is not None and res.verdict == "safe" and res.error is None
    reqs = _requests(http, u)
    assert len(reqs) == len(http.log) - before
    assert [m for m, _p, _r in reqs].count("HEAD") == 1, reqs
    gets = [r for m, _p, r in reqs if m == "GET"]
    assert len(gets) == len(set(gets)) <= 2, gets  # the first block, the end record with the directory
    assert res.bytes_read == http.sent - sent < 2 * BLOCK + (64 << 10) + 64
    assert res.bytes_read < size / 50


@pytest.mark.parametrize("listed", [False, True])
def test_inspecting_one_object_is_one_head_too(served: tuple[Any, str, int], listed: bool) -> None:
    """``inspect`` of a URL (one path, or a row of several) opens the object as often as a scan does, and then
    scans it: one ``HEAD`` in all, no range twice."""
    from ckptool.ops.inspect.many import inspect_target
    from ckptool.ops.scan.many import Target

    http, u, _size = served
    before = len(http.log)
    row = inspect_target(Target(u, listed=listed))
    assert row is not None and row.error is None
    reqs = _requests(http, u)
    assert len(reqs) == len(http.log) - before
    assert [m for m, _p, _r in reqs].count("HEAD") == 1, reqs
    gets = [r for m, _p, r in reqs if m == "GET"]
    assert len(gets) == len(set(gets)), gets


def test_the_store_is_per_block_and_a_recheck_asks_again(served: tuple[Any, str, int]) -> None:
    """Outside :func:`object_reads` each open asks for the object's info (a ``HEAD``); inside one, the first
    answer serves the rest, and :func:`~ckptool._source.recheck` (the evidence that the object is still there)
    asks again."""
    http, u, _size = served
    for _ in range(2):
        with _source.open_binary(u) as f:
            f.read(16)
    assert [m for m, _p, _r in _requests(http, u)].count("HEAD") == 2
    before = len(http.log)
    with _source.object_reads(u):
        for _ in range(3):
            with _source.open_binary(u) as f:
                assert f.read(16)[:4] == b"PK\x03\x04"
        _source.recheck(u)
    assert [m for m, _p, _r in http.log[before:]].count("HEAD") == 2  # the first open's, and the recheck's
    assert [m for m, _p, _r in http.log[before:]].count("GET") == 1


DATA = bytes(range(256)) * 40


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([64, 1000, 20_000]),
       st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(1, 4000), st.sampled_from([0, 100, 3000])),
                min_size=1, max_size=40))
def test_range_store_gives_the_bytes_and_fetches_only_what_it_lacks(limit: int,
                                                                    reads: list[tuple[int, int, int]]) -> None:
    store = RangeStore(limit)
    fetched: list[tuple[int, int]] = []

    def fetch(a: int, b: int) -> bytes:
        fetched.append((a, b))
        return DATA[a:min(b, len(DATA))]

    for start, n, ahead in reads:
        end = min(len(DATA), start + n)
        held = store.ranges()
        asked = len(fetched)
        assert store.read(start, end, fetch, ahead=ahead) == DATA[start:end]
        if any(s <= start and end <= s + len(d) for s, d in held):  # held: no request
            assert len(fetched) == asked
        elif len(fetched) > asked:  # a miss: one request, from the first byte not held
            assert len(fetched) == asked + 1
            assert not any(s <= fetched[-1][0] < s + len(d) for s, d in held)
        spans = store.ranges()
        assert store.held == sum(len(d) for _s, d in spans) <= limit
        assert all(DATA[s:s + len(d)] == d for s, d in spans)
        assert all(s + len(d) < t for (s, d), (t, _e) in itertools.pairwise(spans))
        if limit >= len(DATA):  # nothing dropped: the same read again is answered from memory
            asked = len(fetched)
            assert store.read(start, end, fetch) == DATA[start:end] and len(fetched) == asked


def test_the_head_asked_for_the_cache_serves_the_scan(served: tuple[Any, str, int], tmp_path: Path) -> None:
    """With a cache, an object whose listing gave no version (an HTTP index page) is asked for it (a ``HEAD``)
    before the scan; the scan then uses that answer: one ``HEAD`` in all, not one for the cache and one for the
    scan."""
    from remote_servers import url

    import ckptool

    http, _u, _size = served
    (http.root / "one-head").mkdir()
    _zip(http.root / "one-head" / "model.pt")
    before = len(http.log)
    [res] = ckptool.scan_many([url(http, "one-head/")], cache=tmp_path / "scans.sqlite")
    assert res.verdict == "safe" and res.bytes_read
    assert [m for m, _p, _r in http.log[before:]].count("HEAD") == 1, http.log[before:]
