"""hpcnet.stateful: the parts' entries merged, and which part says who reads a checkpoint tensor."""

import pytest
import torch

from hpcnet.stateful import Entries, Stateful, wanted_by


class _Part(Stateful):
    """A part whose entries every rank reads."""

    def state_entries(self):
        return Entries()

    def load_entries(self, saved):
        pass


class _Sharded(_Part):
    """A part that says which of the names under its prefix this rank reads."""

    def __init__(self, prefix, mine):
        self.prefix, self.mine = prefix, set(mine)

    def wants(self, name):
        return name in self.mine if name.startswith(self.prefix) else None


def test_the_parts_entries_are_merged_in_order_and_a_name_offered_twice_is_refused():
    merged = Entries()
    merged.add(Entries({"model/w": torch.zeros(2)}, meta={"state": 1}))
    merged.add(Entries({"optim/0/x": torch.zeros(1, device="meta")}, {"optim/0/x": 1}, rank_state={"torch": "00"}))
    assert list(merged.tensors) == ["model/w", "optim/0/x"] and merged.holders == {"optim/0/x": 1}
    assert merged.meta == {"state": 1} and merged.rank_state == {"torch": "00"}
    for twice in (Entries({"model/w": torch.ones(2)}), Entries(meta={"state": 2}), Entries(rank_state={"torch": ""})):
        with pytest.raises(ValueError, match="two parts offer"):
            merged.add(twice)


def test_a_checkpoint_tensor_is_read_where_the_part_whose_name_it_is_says():
    plain = _Part()
    assert wanted_by([plain]) is None  # no part chooses: every rank reads everything
    optimizer, feedback = _Sharded("optim/", {"optim/0/x"}), _Sharded("feedback/", {"feedback/1/a"})
    wants = wanted_by([plain, optimizer, feedback])
    assert [wants(name) for name in ("optim/0/x", "optim/1/x", "feedback/0/a", "feedback/1/a", "model/w")] == [
        True, False, False, True, True]
