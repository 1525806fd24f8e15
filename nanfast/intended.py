"""Infinities stored on purpose, which the checks list apart instead of calling them faults: additive
attention masks (-inf where they mask) and score sentinels (a best-so-far score's initial +-inf)."""

from __future__ import annotations

import re

# NOTE: [Additive masks]
# An additive attention mask holds 0 where a position is attended and -inf where it is masked:
# torch.nn.Transformer.generate_square_subsequent_mask makes one, PyTorch's translation tutorial passes
# it to the model's forward (pytorch/tutorials, beginner_source/translation_transformer.py), and many
# GPT-style models keep one as a buffer (register_buffer("mask", torch.triu(torch.full((T, T),
# float("-inf")), 1))). Its -inf are the mask, not a fault: a check that called them non-finite stopped
# a healthy model at its first step, failed every checkpoint holding one, and dropped every batch with
# one. So an entry named as a mask (its name ends in "mask", then any list positions: attention_mask,
# src_mask, tgt_mask, key_padding_mask, model.mask; not masks[0]) whose only non-finite values are -inf
# is listed apart as a mask, not as bad. A NaN or +inf in it is reported as anywhere else; a mask that
# masks a whole row makes NaN in the softmax after it, which is found there. Gradients are never
# masks. Where: the watch's input, check_all (not with grads=True), check_batch and the scans.
# What may follow the part of a name that says what it is: a list's positions, as [i] (check_batch, the
# watch) or .i (check_all, the scans), and check_all's number of a second entry of one name (" (#2)").
_NAME_TAIL = r"(?:\[\d+\]|\.\d+)*(?: \(#\d+\))?"
_MASK_NAME = re.compile(r".*mask" + _NAME_TAIL, re.IGNORECASE)

# NOTE: [Sentinel infinities]
# A score that tracks the best (or worst) value so far starts at an infinity, on purpose: `best_loss =
# float("inf")` in countless training scripts, torch's ReduceLROnPlateau (`best` until its first step,
# `mode_worse` always: both in its state_dict), Lightning's ModelCheckpoint `kth_value` and
# EarlyStopping `best_score` (in every checkpoint a default Lightning Trainer saves; not ModelCheckpoint's
# `best_model_score`, which starts at None); a running minimum
# and maximum the same way: torch.ao.quantization's observers keep `min_val` at +inf and `max_val` at
# -inf until their first forward (in every model prepare_qat returns). A check that called them
# non-finite failed every healthy checkpoint holding one. So a one-element entry that is +inf or -inf
# and whose name's last part names such a score (best..., ..._best, worst..., ..._worst, kth_value,
# mode_worse), or a min_val that is +inf, a max_val that is -inf, is listed apart as a sentinel, not as
# bad. A NaN there, an infinity in a larger tensor of that name, of the other sign in a min_val or
# max_val, or in an entry of any other name (a weight, an optimizer's state, a learning rate, a loss
# scale) is reported as usual. Where: check_all (not with grads=True) and the scans.
def _last_part(pattern: str, flags: int = 0) -> re.Pattern:
    """A name whose last part (after the last ".", "]" or "}", before any list positions) is `pattern`."""
    return re.compile(r"(?:.*[.\]}])?(?:" + pattern + r")" + _NAME_TAIL, flags)


_SCORE_NAME = _last_part(r"best\w*|\w*_best|worst\w*|\w*_worst|kth_value|mode_worse", re.IGNORECASE)
# Lightning's ModelCheckpoint starts best_model_score at None and turns a NaN monitored metric into +-inf:
# an infinity there is a diverged metric, never a starting value (a NaN validation loss saved as +inf was
# left out, the checkpoint called clean: a probe, session 45).
_NOT_A_SCORE_SENTINEL = _last_part("best_model_score")
_MIN_NAME = _last_part("min_val")
_MAX_NAME = _last_part("max_val")

# How the messages call each kind, after "left out, as".
MASKS = "additive masks (-inf where they mask)"
SENTINELS = ("infinities a best or worst score or a running min or max starts from (best_loss, "
             "ReduceLROnPlateau's mode_worse, kth_value, an observer's min_val)")


def is_mask_name(name: str) -> bool:
    """Whether `name` names a mask (see NOTE: [Additive masks]), whatever it holds."""
    return _MASK_NAME.fullmatch(name) is not None


def is_additive_mask(name: str, nan: int, posinf: int, neginf: int) -> bool:
    """Whether the entry `name` with these counts is an additive mask (see NOTE: [Additive masks]): the
    name ends in "mask" (then any list positions) and its only non-finite values are -inf."""
    return neginf > 0 and nan == 0 and posinf == 0 and is_mask_name(name)


def is_sentinel(name: str, numel: int, nan: int, posinf: int, neginf: int) -> bool:
    """Whether the entry `name` is a sentinel infinity (see NOTE: [Sentinel infinities]): one element,
    +inf or -inf, named as a best or worst score; or a min_val at +inf, a max_val at -inf."""
    if numel != 1 or nan != 0 or posinf + neginf != 1:
        return False
    if _SCORE_NAME.fullmatch(name) is not None:
        return _NOT_A_SCORE_SENTINEL.fullmatch(name) is None
    return _MIN_NAME.fullmatch(name) is not None if posinf else _MAX_NAME.fullmatch(name) is not None

