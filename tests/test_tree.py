"""nanfast._tree: the one walker over containers, and the grouping by device."""

from __future__ import annotations

import collections
import dataclasses

import torch

from nanfast._tree import group_by_device, is_container, leaves, named_leaves


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int


def test_paths_of_every_kind_of_container():
    Pair = collections.namedtuple("Pair", ["left", "right"])
    t = torch.ones(1)
    obj = {"a": [t, (t, "s")], "pair": Pair(t, Sample(t, 3)), "queue": collections.deque([t])}
    dotted = ["a.0", "a.1.0", "a.1.1", "pair.left", "pair.right.image", "pair.right.label", "queue.0"]
    assert [name for name, _ in named_leaves(obj)] == dotted
    assert [name for name, _ in named_leaves(obj, brackets=True)] == [
        "a[0]", "a[1][0]", "a[1][1]", "pair.left", "pair.right.image", "pair.right.label", "queue[0]"]
    assert [leaf for _, leaf in named_leaves(obj)][5] == 3  # every leaf comes back, not only tensors
    assert [id(leaf) for leaf in leaves(obj)] == [id(leaf) for _, leaf in named_leaves(obj)]


def test_leaf_root_and_prefix():
    t = torch.ones(3)
    assert list(named_leaves(t, "x")) == [("x", t)] and not is_container(t) and not is_container(Sample)
    assert [name for name, _ in named_leaves([t], "inputs", brackets=True)] == ["inputs[0]"]
    assert [name for name, _ in named_leaves({0: [t]}, "state", brackets=True)] == ["state.0[0]"]


def test_name_pairs_only_at_the_root_and_only_with_a_str_name():
    t, u = torch.ones(1), torch.zeros(1)
    items = [("w", t), (t, u), ("nested", {"b": u}), ("a", "b", t)]
    assert [name for name, _ in named_leaves(iter(items), name_pairs=True)] == [
        "w", "1.0", "1.1", "nested.b", "3.0", "3.1", "3.2"]
    assert [name for name, _ in named_leaves({"k": [("w", t)]})] == ["k.0.0", "k.0.1"]


def test_cycles_are_entered_once_and_depth_is_unbounded():
    loop: list = [1]
    loop.append({"back": loop, "x": 2})
    assert list(named_leaves(loop)) == [("0", 1), ("1.x", 2)] and list(leaves(loop)) == [1, 2]
    deep: list = [7]
    for _ in range(10_000):
        deep = [deep]
    ((name, leaf),) = named_leaves(deep)
    assert leaf == 7 and name.count(".") == 10_000


def test_group_by_device_keeps_first_appearance_order():
    cpu, meta = torch.ones(1), torch.ones(1, device="meta")
    assert group_by_device([cpu, cpu]) == {torch.device("cpu"): [0, 1]}
    groups = group_by_device([meta, cpu, meta])
    assert list(groups) == [torch.device("meta"), torch.device("cpu")] and groups[torch.device("meta")] == [0, 2]
    assert group_by_device([]) == {}
