"""The files a path given to `python -m nanfast scan` stands for: a checkpoint file, a directory's
checkpoint files (its subdirectories' too), or the shards a sharded checkpoint's index names; and the
tensors an index lists that its shards do not hold."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Optional, Union

from .readers import first_sentence
from .readers.dcp import is_dcp_directory
from .readers.torch_save import is_torch_save
from .report import Report, first_few
from .scan import MAX_NAMED_IN_MESSAGE, FileScan

# What `checkpoint_files` takes from a directory: torch.save files (Lightning's .ckpt, the HF Trainer's
# optimizer.pt and rng_state.pth, pytorch_model.bin, timm's checkpoint-N.pth.tar), safetensors files, numpy's
# .npy and .npz, PT2 archives.
CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".pth.tar", ".bin", ".ckpt", ".npy", ".npz", ".pt2")


def checkpoint_files(path: str) -> Union[list[str], FileScan]:
    """The files that `python -m nanfast scan PATH` reads for `path`.

    Args:
        path: a checkpoint file; a directory (a Trainer's checkpoint-500/, a save_pretrained output),
            for its entries ending in CHECKPOINT_SUFFIXES (a dangling link or a FIFO among them is
            then reported as not read) and the torch.save files named otherwise (accelerate's *.pkl),
            and those of its subdirectories (NOTE: [A directory's subdirectories]), and the shards any
            index in them names
            (a missing one is reported); or the index of a
            sharded checkpoint (*.index.json, as transformers writes), for the shards its "weight_map"
            names, next to it.

    Returns:
        The paths, sorted for a directory, in the index's order for an index, and after them the FileScan
        ("unreadable") of each folder under a directory that could not be listed; or the FileScan of
        `path` when it names none: a directory with no checkpoint file ("refused"), an index that is not
        one ("unreadable")."""
    path = _without_extra_separators(path)
    if is_dcp_directory(path):  # one checkpoint, read as a whole (NOTE: [Distributed checkpoints])
        return [path]
    if os.path.isdir(path):
        files: set[str] = set()
        unlisted: list[FileScan] = []
        for folder, names in _folders(path, files, unlisted):
            # Every entry named as a checkpoint but a directory: one that cannot be read (a dangling link, a
            # FIFO) is then reported, never left out; and the shards an index in it names, so that a missing
            # one is reported too.
            files.update(full for name in names
                         if name.endswith(CHECKPOINT_SUFFIXES) and not os.path.isdir(full := os.path.join(folder, name)))
            # torch.save files named otherwise (accelerate's random_states_0.pkl and custom_checkpoint_0.pkl,
            # which hold tensors: left out, a directory was called clean without them)
            # (or that cannot be opened: reported as not read, never left out)
            files.update(full for name in names if is_torch_save(full := os.path.join(folder, name), unopened=True))
            for name in names:
                if name.endswith(".index.json") and isinstance(shards := _index_shards(os.path.join(folder, name)), list):
                    files.update(shards)
        if files or unlisted:
            return [*sorted(files), *unlisted]
        return FileScan(path, "refused", error="a directory with no checkpoint file in it or its "
                        f"subdirectories (*{', *'.join(CHECKPOINT_SUFFIXES)}): nothing was checked")
    if path.endswith(".index.json") and os.path.isfile(path):
        return _index_shards(path)
    return [path]


def _index_shards(path: str) -> Union[list[str], FileScan]:
    """The shard files a sharded checkpoint's index names (next to it, in its order), or its FileScan
    ("unreadable") when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            shards = dict.fromkeys(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # (JSON nested deep)
        return FileScan(path, "unreadable", error=f"not a sharded checkpoint's index (a JSON object with a "
                                                  f"\"weight_map\"): {type(e).__name__}: {first_sentence(e)}")
    if not shards or not all(isinstance(shard, str) for shard in shards):
        return FileScan(path, "unreadable", error="its \"weight_map\" names no shard files: nothing was checked")
    # Shards lie next to their index (as transformers writes them): a name that leads elsewhere
    # ("../other/model.safetensors", an absolute path) is refused, as the DCP reader refuses such links.
    outside = [shard for shard in shards if os.path.basename(shard) != shard or shard in (".", "..")]
    if outside:
        return FileScan(path, "refused", error=f"its \"weight_map\" names shards outside its directory "
                                               f"({first_few(outside, MAX_NAMED_IN_MESSAGE)}): nothing was checked")
    return [os.path.join(os.path.dirname(path), shard) for shard in shards]


def indexes_of(path: str) -> list[str]:
    """The sharded checkpoints' indexes (*.index.json) `path` names: itself, or those in a directory and
    its subdirectories."""
    path = _without_extra_separators(path)
    if path.endswith(".index.json") and os.path.isfile(path):
        return [path]
    if os.path.isdir(path) and not is_dcp_directory(path):
        return sorted(os.path.join(folder, name) for folder, names in _folders(path, set(), [])
                      for name in names if name.endswith(".index.json"))
    return []


def _without_extra_separators(path: str) -> str:
    """`path` without repeated or trailing separators: a directory given as DIR// listed DIR//x beside the
    DIR/x its index names, read each shard twice, and compared no shard with the index (a probe, session
    52). Not normpath: "link/.." is left to the system to resolve."""
    collapsed = re.sub(r"/{2,}", "/", path)
    return collapsed.rstrip("/") or collapsed


# NOTE: [A directory's subdirectories]
# A Trainer's output directory holds the final weights and a checkpoint-N/ folder per save: a scan of it
# that read the top folder only said "clean" (exit 0) while checkpoint-4/optimizer.pt held inf (a probe,
# session 45). So a directory is read with every folder under it; a distributed checkpoint among them is
# one checkpoint, read whole; links to directories are not followed (a loop, or a tree elsewhere).
def _folders(path: str, checkpoints: set[str], unlisted: list[FileScan]) -> Iterator[tuple[str, list[str]]]:
    """Each folder of the tree at directory `path` (itself first, then its subdirectories, sorted) with
    the names of its entries that are not directories (links to directories are left out); the
    distributed checkpoints found under it are added to `checkpoints` instead of entered, and a folder
    that cannot be listed to `unlisted` as its FileScan (a subdirectory without read permission was
    skipped unsaid, and the scan said clean: a probe, session 52)."""
    def unreadable(e: OSError) -> None:
        unlisted.append(FileScan(e.filename or path, "unreadable", error=f"a folder that could not be listed: {e}"))

    for folder, subfolders, names in os.walk(path, onerror=unreadable):
        subfolders.sort()
        for name in list(subfolders):
            full = os.path.join(folder, name)
            if os.path.islink(full):
                subfolders.remove(name)
            elif is_dcp_directory(full):
                checkpoints.add(full)
                subfolders.remove(name)
        yield folder, names


def index_gaps(index: str, scans: dict[str, FileScan]) -> Optional[FileScan]:
    """The tensors a sharded checkpoint's index lists in a .safetensors shard that the shard does not
    hold (a shard rewritten or copied from another save: transformers then fails on missing keys), as
    the index's FileScan ("incomplete", each one not checked); None when every one is there.

    Only .safetensors shards are compared: each of their tensors is stored under its own name, where a
    torch.save shard holds tied weights once (the scan names the first of them). A shard that is
    missing or could not be read is reported by its own FileScan.

    Args:
        index: the index's path.
        scans: the FileScans of the shards, by path.

    Returns:
        The index's FileScan for what is missing, or its own when it names no shard to read (and `scans`
        does not hold it: the index was not scanned as an argument itself), or None."""
    shards = _index_shards(index)
    if not isinstance(shards, list):  # not an index, or refused: said here when a directory holds it
        return None if index in scans else shards
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    found: dict[str, set[str]] = {}
    for shard in shards:
        scan = scans.get(shard)
        if shard.endswith(".safetensors") and scan is not None and scan.report is not None:
            found[shard] = {e.name for e in scan.report.entries} | {name for name, _ in scan.not_checked}
    base = os.path.dirname(index)
    missing = tuple((name, f"listed in the index for {shard}, which does not hold it")
                    for name, shard in weight_map.items()
                    if os.path.join(base, shard) in found and name not in found[os.path.join(base, shard)])
    return FileScan(index, "incomplete", Report(()), not_checked=missing) if missing else None
