"""nanfast._tree: the one walker over containers, and the grouping by device."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import tracemalloc

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
    # Its 10,001 steps: 16 at each end, the levels between counted (a name linear in nothing).
    assert leaf == 7 and name == ".".join(["0"] * 16) + "<9969-levels>." + ".".join(["0"] * 16)


def test_deep_paths_keep_their_ends_and_cost_no_more_than_the_input():
    """A crafted checkpoint: thousands of distinct leaves thousands of levels deep were named each in
    full, so an 80 KB file took 810 MB and 9.6 s to scan (quadratic); each name now keeps 16 steps at
    each end."""
    node: list = [{"w": float(i)} for i in range(3)]
    for _ in range(2000):
        node = [node]
    names = [name for name, _ in named_leaves({"deep": node}, brackets=True)]
    assert names == [f"deep{'[0]' * 15}<1971-levels>{'[0]' * 14}[{i}].w" for i in range(3)]
    shallow = [[{"w": 1.0}]] * 2  # 4 steps deep: whole, and the shared list walked at each path
    assert [name for name, _ in named_leaves(shallow, brackets=True)] == ["[0][0].w", "[1][0].w"]
    exact: list = [5.0]
    for _ in range(31):  # 32 steps: the most a path is written whole
        exact = [exact]
    ((name, _),) = named_leaves(exact, brackets=True)
    assert name == "[0]" * 32


def test_leaves_once_yields_a_shared_leaf_at_its_first_path():
    shared, other = float("nan"), torch.zeros(2)
    obj = {"a": [shared, other], "b": (other, shared, 3.0)}
    assert [n for n, _ in named_leaves(obj, leaves_once=True)] == ["a.0", "a.1", "b.2"]
    assert len(list(named_leaves(obj))) == 5


def test_group_by_device_keeps_first_appearance_order():
    cpu, meta = torch.ones(1), torch.ones(1, device="meta")
    assert group_by_device([cpu, cpu]) == {torch.device("cpu"): [0, 1]}
    groups = group_by_device([meta, cpu, meta])
    assert list(groups) == [torch.device("meta"), torch.device("cpu")] and groups[torch.device("meta")] == [0, 2]
    assert group_by_device([]) == {}


def test_sets_and_tensor_attributes():
    t, scale = torch.nn.Parameter(torch.ones(1)), torch.zeros(1)
    t.scale = scale  # torch.save keeps a tensor's attributes
    obj = {"s": frozenset([3]), "w": t}
    assert list(named_leaves(obj, brackets=True)) == [("s{0}", 3), ("w", t)]
    assert list(named_leaves(obj)) == [("s.0", 3), ("w", t)] and is_container({1})
    assert list(named_leaves(obj, brackets=True, tensor_attributes=True)) == [("s{0}", 3), ("w", t), ("w.scale", scale)]


def test_shared_containers_walked_at_each_path_or_once():
    t = torch.ones(1)
    shared = [t]
    assert [name for name, _ in named_leaves({"a": shared, "b": shared})] == ["a.0", "b.0"]
    assert [name for name, _ in named_leaves({"a": shared, "b": shared}, shared_once=True)] == ["a.0"]
    # 2^100 paths through 100 lists: walked once each, a crafted checkpoint is walked in linear time.
    crafted: list = [t]
    for _ in range(100):
        crafted = [crafted, crafted]
    assert [name for name, _ in named_leaves(crafted, brackets=True, shared_once=True)] == [
        "[0]" * 16 + "<69-levels>" + "[0]" * 16]


class FreshLists(collections.abc.Mapping):
    """A mapping whose values are new lists at each access (a lazy view): freed once walked."""

    def __init__(self, keys, t):
        self.keys_, self.t = keys, t

    def __getitem__(self, key):
        return [self.t]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self):
        return len(self.keys_)


def test_a_container_freed_during_the_walk_is_not_taken_for_a_later_one():
    """Containers are known by id: one freed during the walk could give its id to a new one."""
    t = torch.ones(1)
    obj = [FreshLists(range(50), t) for _ in range(20)]
    assert len(list(named_leaves(obj, shared_once=True))) == 1000


def test_deep_paths_cost_memory_linear_in_depth():
    deep: list = [torch.ones(1)]
    for _ in range(10_000):
        deep = [deep]
    tracemalloc.start()
    try:
        ((name, _),) = named_leaves(deep, brackets=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # A path string kept for each level would be 150 MB; the name keeps 16 steps at each end.
    assert name == "[0]" * 16 + "<9969-levels>" + "[0]" * 16 and peak < 20 * 2**20


class _Subclass(torch.Tensor):
    pass


def test_the_watchs_fast_path_finds_what_the_walker_finds():
    """nanfast.watcher.hooks.floating_tensors takes a C++ path for a tensor and for a tuple or list of
    tensors and None (a module's usual arguments and outputs) and walks anything else (a floating sparse
    tensor too): either way the floating and complex strided tensors the one walker finds, in its order,
    and a floating sparse tensor's stored values."""
    from nanfast import _C
    from nanfast.watcher.hooks import floating_tensors

    x, h = torch.randn(3), torch.randn(2, dtype=torch.float16)
    sparse, csr = torch.randn(4).to_sparse(), torch.randn(2, 3).to_sparse_csr()
    kinds = [x, h, torch.arange(3), torch.ones(2, dtype=torch.bool), torch.randn(2, dtype=torch.complex64),
             torch.arange(4).to_sparse(), torch.zeros(2, dtype=torch.float8_e4m3fn),
             torch.nn.Parameter(torch.randn(2)), torch.randn(2, 2).t()]
    Pair = collections.namedtuple("Pair", "a b")
    fast = [x, h, kinds[-2], (), tuple(kinds), list(kinds), (x, None, h), [None, None], (x, x)]
    walked = [(x, 1), (x, (h,)), {"a": x}, Pair(x, h), (x, "label"), _Subclass(torch.randn(2)),
              (x, _Subclass(torch.randn(2))), Sample(x, 1), None, 3, sparse, (x, sparse, h), [csr, None]]

    def expected(obj):
        return [t._values() if t.layout == torch.sparse_coo else t.values() if t.layout != torch.strided else t
                for t in leaves(obj) if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
                and t.layout in (torch.strided, torch.sparse_coo, torch.sparse_csr)]

    def same(t):  # a sparse tensor's values are a new view at each call: the same memory
        return t.data_ptr(), t.shape, t.dtype

    for obj in fast + walked:
        assert [same(t) for t in floating_tensors(obj)] == [same(t) for t in expected(obj)], obj
    assert all(_C.plain_floating_tensors(obj) is not None for obj in fast)
    assert all(_C.plain_floating_tensors(obj) is None for obj in walked)
