"""Key matching in ``ckptool.torch_ops.select`` is linear in the number of keys (issue 27): the model's keys are
put in a set once per call, not once per checkpoint key (20,000 keys took 30 s with ``prefixes`` other than
``"auto"``). Speed is not timed here: the model keys are a list that counts how often it is walked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckptool.torch_ops.select import reconciliation

pytestmark = pytest.mark.torchfree

N = 20_000


class CountingKeys(list[str]):
    """A list of keys that counts the walks over it (``set(keys)`` is one) and fails once there are too many."""

    def __init__(self, keys: list[str], limit: int = 2) -> None:
        super().__init__(keys)
        self.walks = 0
        self.limit = limit

    def __iter__(self) -> Iterator[str]:
        self.walks += 1
        assert self.walks <= self.limit, f"the model keys were walked {self.walks} times for one call"
        return super().__iter__()


@pytest.mark.parametrize("prefixes", [None, False, "none", "module.", ["module."], ["module.", "_orig_mod."]])
def test_reconciliation_walks_the_model_keys_once(prefixes: object) -> None:
    model = [f"layers.{i}.weight" for i in range(N)]
    saved = model if prefixes in (None, False, "none") else [f"module.{k}" for k in model]
    keys = CountingKeys(model)
    rec = reconciliation(saved, keys, prefixes)  # type: ignore[arg-type]
    assert rec.matched == N
    assert keys.walks == 1
    if prefixes in (None, False, "none"):
        assert rec.mapping == {k: k for k in model}
    else:
        assert rec.mapping[f"module.layers.{N - 1}.weight"] == f"layers.{N - 1}.weight"


def test_reconciliation_counts_only_keys_the_model_has() -> None:
    rec = reconciliation(["module.a", "module.b", "c"], ["a", "c", "d"], "module.")
    assert rec.matched == 2 and rec.mapping == {"module.a": "a", "module.b": "b", "c": "c"}
    assert reconciliation(["a", "b"], ["a"], None).matched == 1


def test_select_state_dict_ranks_candidates_with_one_set_of_model_keys() -> None:
    torch = pytest.importorskip("torch")
    from ckptool.torch_ops.select import select_state_dict

    t = torch.zeros(1)
    model = [f"layers.{i}.weight" for i in range(200)]
    obj = {f"cand{j}": dict.fromkeys(model[:10 * j], t) for j in range(1, 11)}
    keys = CountingKeys(model)
    path, sd, paths = select_state_dict(obj, None, keys, prefixes=None)
    assert path == "cand10" and len(sd) == 100 and len(paths) == 10
    assert keys.walks == 1
