"""The model's input as the watch checks it: its floating tensors, with a layout that names them later,
and, on a step whose input was dirty, the names of the entries that held the non-finite values
("targets[1].boxes", "pixel_values"), from the layout and the forward's signature."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import _C, _tree
from ..check import READ_LAYOUTS, stored_values
from ..intended import is_mask_name

# NOTE: [Naming the input's entries]
# A dirty batch is bad data, and the question is which field: a detection target's box, the images, a
# float mask. The input is checked in one record whose rows are its tensors, in walk order; naming them
# needs the input's structure, but only on a bad step, after the forward (the batch may be gone: a
# lagged read comes a step later). So each forward keeps a layout that holds no tensor: for a tuple of
# tensors (the C++ fast path), None when every argument is a floating tensor, else the positions of
# those that are; for anything else (keyword arguments, lists, dicts), each tensor's node from the one
# container walker (its keys up to the root). A bad step turns a row into a name: positions and keyword
# arguments are named by the forward's signature, and the rest of the path is written as check_batch
# writes it. A layout whose rows no longer match (it cannot, short of a bug) names nothing.


class Layout(NamedTuple):
    """Where each floating tensor of one forward's input came from (see NOTE: [Naming the input's entries])."""

    positions: Optional[tuple[int, ...]] = None  # the fast path: argument positions (None: all of them)
    nodes: Optional[list] = None  # the walker's path: one node per tensor
    keywords: bool = False  # the walked root was (args, kwargs)


_READ_LAYOUTS = (torch.jagged, *READ_LAYOUTS)


def checked_tensor(t: Any) -> bool:
    """Whether the watch checks `t`: a floating or complex strided tensor (what the C++ fast path,
    plain_floating_tensors, keeps; the container walker's path keeps the same), a jagged nested one
    (read through its values, NOTE: [Tensor subclasses read through their plain tensors]) or a sparse
    one (read through its stored values, by the walker: a NaN in a sparse input batch was blamed on the
    first module that read it)."""
    return (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
            and t.layout in _READ_LAYOUTS)


def input_tensors(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Layout]:
    """The floating strided tensors of a forward's input, and their layout.

    Args:
        args, kwargs: the forward's arguments, as its forward pre-hook receives them.

    Returns:
        (tensors, layout): the tensors in walk order (a tuple of tensors and None by a C++ fast path,
        anything else by the one container walker, the same ones either way)."""
    if not kwargs:
        found = _C.plain_floating_tensors(args)
        if found is not None:
            positions = None if len(found) == len(args) else tuple(i for i, a in enumerate(args) if checked_tensor(a))
            return found, Layout(positions=positions)
    tensors, layout = walked_tensors((args, kwargs) if kwargs else args)
    return tensors, layout._replace(keywords=bool(kwargs))


def walked_tensors(obj: Any) -> tuple[list[torch.Tensor], Layout]:
    """The floating strided tensors in obj found by the one container walker, and their layout: what
    the C++ module hooks ask for an input or output that is not a tensor or a tuple of them."""
    tensors, nodes = [], []
    for node, leaf in _tree.leaves_with_nodes(obj):
        if checked_tensor(leaf):
            tensors.append(stored_values(leaf, coalesced=False))
            nodes.append(node)
    return tensors, Layout(nodes=nodes)


def output_names(layout: Optional[Layout], rows: int) -> Optional[list[str]]:
    """The names of the `rows` tensors of the record of a module's output ("loss", "logits", "[1]"), from
    its `layout` (walked_tensors' second part, from the watch's or the C++ hooks' walk), or None when the layout cannot name them."""
    # NOTE: [Naming the output's fields]
    # A HF model computes its loss inside its forward (a functional cross-entropy, no module): a NaN loss
    # (every label ignore_index) first appears in the model's output, which is a dict of the loss, the
    # logits and the cache. "output of <model>" did not say which (a probe, session 45); nor, the model
    # wrapped (a PEFT model, a LightningModule), did the output of the submodule that made it, nor a
    # torchvision detector's RoIHeads' dict of losses. The layout of an output is kept, without its
    # tensors, by the record's slot id until the step is read: for a submodule where the C++ hooks walk
    # it anyway (a dict, a dataclass: not a tensor or a tuple of them, which cost no Python call), for
    # the model itself whenever it is not a bare tensor (once per forward). The gradients of the loss
    # w.r.t. the model's output take one slot per floating tensor, each slot's layout that tensor's node
    # (Hooks._hook_output_grads): "w.r.t. the output of <model>" did not say which output of a Siamese
    # model's tuple had the NaN gradient.
    if layout is None or layout.nodes is None or len(layout.nodes) != rows:
        return None
    return [_tree.path_of(_tree.path_steps(node), brackets=True) for node in layout.nodes]


def _argument_namer(forward: Callable) -> Callable[[int], str]:
    """The name of positional argument i of `forward`: its parameter's, "*name[k]" past them, else "args[i]"."""
    positional, rest, _ = _signature_of(forward)

    def name(i: int) -> str:
        if i < len(positional):
            return positional[i]
        return f"{rest}[{i - len(positional)}]" if rest is not None else f"args[{i}]"

    return name


def _signature_of(forward: Callable) -> tuple[tuple[str, ...], Optional[str], bool]:
    """_signature of `forward`: of a bound method's function, read once per function (a class's, which
    keeps no model alive), less `self`; of any other callable (a closure may hold the model), each time."""
    func = getattr(forward, "__func__", None)
    if func is None:
        return _signature.__wrapped__(forward)
    positional, rest, masks = _signature(func)
    return positional[1:], rest, masks


@functools.lru_cache(maxsize=64)
def _signature(forward: Callable) -> tuple[tuple[str, ...], Optional[str], bool]:
    """The positional parameters' names of `forward`, its *args parameter's (None without one), and
    whether any positional argument's name is a mask's (see NOTE: [Additive masks])."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin, a C++ module)
        parameters = []
    positional = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    rest = next((p.name for p in parameters if p.kind == p.VAR_POSITIONAL), None)
    masks = any(is_mask_name(name) for name in positional) or (rest is not None and is_mask_name(f"{rest}[0]"))
    return positional, rest, masks


def entry_names(layout: Optional[Layout], rows: int, forward: Callable) -> Optional[list[str]]:
    """The names of a recorded input's `rows` tensors, or None when the layout cannot name them.

    Args:
        layout: what input_tensors gave for that forward.
        rows: the number of rows of its record (one per tensor).
        forward: the model's forward, whose signature names the arguments."""
    if layout is None:
        return None
    argument = _argument_namer(forward)
    if layout.nodes is None:
        positions = range(rows) if layout.positions is None else layout.positions
        return [argument(i) for i in positions] if len(positions) == rows else None
    if len(layout.nodes) != rows:
        return None
    names = []
    for node in layout.nodes:
        steps = _tree.path_steps(node)
        if layout.keywords:  # (args, kwargs): 0 or 1 first
            which, steps = steps[0][0], steps[1:]
            head = argument(steps[0][0]) if which == 0 else str(steps[0][0])
        else:
            head = argument(steps[0][0])
        names.append(_tree.path_of(steps[1:], head, brackets=True))
    return names


def mask_rows(layout: Layout, rows: int, forward: Callable) -> tuple[int, ...]:
    """The rows of a forward's input record named as masks, whose -inf are not counted (see NOTE:
    [Additive masks]).

    Args:
        layout, rows, forward: as entry_names takes them.

    Returns:
        Their indices, in row order (none when the layout cannot name the rows)."""
    if layout.nodes is None and not _signature_of(forward)[2]:  # the fast path: tensors given by position
        return ()
    names = entry_names(layout, rows, forward)
    return () if names is None else tuple(i for i, name in enumerate(names) if is_mask_name(name))
