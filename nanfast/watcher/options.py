"""The watch's options: their allowed values, the modules left unhooked by default, and the checks that
reject a combination the watch could not honour."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch

ACTIONS = ("raise", "warn", "skip", "rollback")
SKIPPING = ("skip", "rollback")  # the actions that skip a bad step (rollback: one whose parameters are finite)
# action="rollback": snapshot the state every ROLLBACK_EVERY steps into ROLLBACK_DEVICE's memory (see
# NOTE: [Rolling back] in rollback.py for why these defaults).
ROLLBACK_EVERY = 100
ROLLBACK_DEVICE = "cpu"
# Read every parameter at least once in PARAMS_EVERY checked steps (see NOTE: [Parameters read when they
# add information] in fused_pass.py).
PARAMS_EVERY = 100
# fuse=True: the most bytes of deferred tensors a watch keeps alive past their use before checking them
# (see NOTE: [Fused records] in csrc/python/watch_records.h).
FUSE_BYTES = 64 << 20
ON_EVENT = (None, "locate")
SYNC_MODES = ("eager", "lagged")

# NOTE: [Modules that cannot make non-finite values]
# These only select, zero, reorder or reshape their input, scale it by 1/(1-p) (dropout), or map it
# through a function whose value is bounded or at most |x| and whose derivative is at most about 1
# (tanh, sigmoid, their hard versions, softsign, SiLU): their outputs and input gradients are
# non-finite only where their inputs are (a dropout or SiLU could overflow only values or gradients
# within 1/(1-p), resp. ~10%, of the dtype's maximum), so checking them would find propagation, never
# a producer (tested on every 16-bit input). They get no hooks: in a ResNet every ReLU re-reads the
# BatchNorm output it modified in place, in a transformer the dropouts are a third of all activation
# bytes. (A value they squash to finite, tanh(-inf), was non-finite in their input; their own output
# check would not see it either.) GELU is not one of them: its exact form overflows from inputs above
# half the maximum (x * (1 + erf) in float32 or bfloat16), its tanh form's gradient is NaN above ~1e19.
# `pass_through=()` checks them too.
PASS_THROUGH = (
    torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten,
    torch.nn.MaxPool1d, torch.nn.MaxPool2d, torch.nn.MaxPool3d,
    torch.nn.AdaptiveMaxPool1d, torch.nn.AdaptiveMaxPool2d, torch.nn.AdaptiveMaxPool3d,
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
    torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Hardtanh, torch.nn.Hardsigmoid, torch.nn.Softsign, torch.nn.SiLU,
)

# torch's activations that, made with inplace=True, write their input and return it, and make no NaN or inf
# from finite values (NOTE: [Non-finite values an in-place activation keeps] in csrc/python/deferred_records.h);
# the ones of PASS_THROUGH among them are hooked only with `pass_through=()`.
KEEPS_NONFINITE_IN_PLACE = (
    torch.nn.ReLU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.RReLU, torch.nn.ELU, torch.nn.CELU, torch.nn.SELU,
    torch.nn.Hardtanh, torch.nn.Hardsigmoid, torch.nn.Hardswish, torch.nn.SiLU, torch.nn.Mish,
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
)


def patterns(ignore: Union[str, Iterable[str]]) -> tuple[str, ...]:
    """The `ignore` option as a tuple of fnmatch patterns (one string is one pattern).

    Raises:
        TypeError: ignore is not a string or an iterable of strings."""
    found = (ignore,) if isinstance(ignore, str) else tuple(ignore) if isinstance(ignore, Iterable) else None
    if found is None or not all(isinstance(p, str) for p in found):
        raise TypeError(f"nanfast.watch: ignore must be a string or strings (fnmatch patterns of module, parameter "
                        f"or loss names, or 'input'), got {ignore!r}")
    return found


def unknown_options(given: Iterable[str], known: Iterable[str]) -> None:
    """Raises TypeError naming the first option of `given` that is not in `known`, with the closest known
    one (a typo such as actoin="skip" would otherwise name Watch.__init__)."""
    known = list(known)
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"nanfast.watch: unknown option {name!r}{hint}; see help(nanfast.watch)")


def ignored(ignore: tuple[str, ...], name: str) -> bool:
    """Whether `name` (a module, parameter or loss name, or "input") matches one of the patterns."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore)


def steps_option(name: str, value: Any, least: int = 1) -> int:
    """A number of steps given as an option (every, params_every, rollback_every; first_step, from 0).

    Args:
        name: the option's name, for the error.
        value: what was given.
        least: the smallest value allowed.

    Returns:
        value, an int >= least.

    Raises:
        ValueError: value is not an int >= least."""
    if type(value) is not int or value < least:
        raise ValueError(f"nanfast.watch: {name} must be an int >= {least}, got {value!r}")
    return value


def stepped_optimizer(optimizer: Any) -> Any:
    """The optimizer whose step the watch hooks: accelerate's AcceleratedOptimizer (which HF's Trainer
    and a hand-written accelerate loop step) is a torch Optimizer subclass that never ran
    Optimizer.__init__, so it has no step hooks; it keeps the torch optimizer it steps as `.optimizer`,
    and the hooks go on that one. A wrapper that is a whole Optimizer (a Lookahead) is hooked itself,
    as the optimizer the loop steps.

    Args:
        optimizer: a torch optimizer, such a wrapper, None, or anything else (returned as it is, for
            `validate` to refuse).

    Returns:
        The first optimizer down the `.optimizer` chain that has step hooks, or `optimizer` itself."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if hasattr(optimizer, "_optimizer_step_pre_hooks") or not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def validate(model: Any, optimizer: Any, action: Union[str, Callable], every: Any, sync: str, scaler: Optional[Any],
             on_event: Optional[str], rerun: Optional[Callable]) -> bool:
    """Rejects options the watch could not honour.

    Args:
        model, optimizer, action, every, sync, scaler, on_event, rerun: as given to `nanfast.watch`.

    Returns:
        Whether a skip happens on the device (see NOTE: [Skipping a step]): action "skip", sync
        "lagged" and an optimizer that takes a `found_inf` tensor.

    Raises:
        TypeError: model is not an nn.Module (or is a TorchScript one), or optimizer not a torch.optim.Optimizer.
        ValueError: an option out of its allowed values, or a combination the watch cannot honour."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"nanfast.watch: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):  # its error came from deep inside the watch's setup
        raise TypeError(f"nanfast.watch: model is a TorchScript module ({type(model).__name__}, from torch.jit.script "
                        "or torch.jit.trace), which runs no Python hooks: watch the eager module you scripted")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"nanfast.watch: optimizer must be a torch.optim.Optimizer (or a wrapper holding one as "
                        f".optimizer), got {type(optimizer).__name__}")
    if not callable(action) and action not in ACTIONS:
        raise ValueError(f"nanfast.watch: action must be one of {ACTIONS} or a callable, got {action!r}")
    if sync not in SYNC_MODES:
        raise ValueError(f"nanfast.watch: sync must be one of {SYNC_MODES}, got {sync!r}")
    steps_option("every", every)
    if scaler is not None and optimizer is None:
        raise ValueError("nanfast.watch: scaler= needs the optimizer it steps")
    if on_event not in ON_EVENT:
        raise ValueError(f"nanfast.watch: on_event must be one of {ON_EVENT}, got {on_event!r}")
    if on_event == "locate":
        if not callable(rerun):
            raise ValueError("nanfast.watch: on_event='locate' needs rerun=, a callable that runs the step's forward "
                             "and backward again on the same batch (no optimizer step)")
        if sync != "eager":
            raise ValueError("nanfast.watch: on_event='locate' needs sync='eager': the step is re-run before the "
                             "optimizer applies it")
    # NOTE: [Skipping a step]
    # A skipped step must leave parameters and optimizer state exactly as they were. With the host's
    # verdict before the step (the eager read, made in the step pre-hook), the optimizer is given no
    # gradients for that step: every torch optimizer leaves a parameter without a .grad, and its
    # state, untouched (fused ones included: handed found_inf instead, a first step would still
    # create their state, fused SGD's momentum buffers with empty_like). A lagged watch knows only on
    # the device: optimizers that take a `found_inf` tensor (fused=True, the protocol GradScaler
    # uses) get the flag of this step's checks and skip there; a step they could not undo that way
    # (one that creates optimizer state) is read at once instead (see Watch._end_step).
    skipping = not callable(action) and action in SKIPPING
    skip_on_device = (skipping and sync == "lagged"
                      and bool(getattr(optimizer, "_step_supports_amp_scaling", False)))
    if skipping:
        if optimizer is None:
            raise ValueError(f"nanfast.watch: action={action!r} needs the optimizer whose step it skips")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                f"nanfast.watch: action={action!r} cannot skip LBFGS steps: LBFGS runs the forward and backward "
                "inside optimizer.step(closure), after the point where the watch decides (the step pre-hook), "
                "and updates the parameters between closure calls; use action='raise' (see docs/watch.md)")
        if sync == "lagged" and not skip_on_device:
            raise ValueError(
                f"nanfast.watch: action={action!r} with sync='lagged' needs an optimizer that skips on the device "
                f"(fused=True Adam, AdamW, SGD or Adagrad); {type(optimizer).__name__} needs the host's verdict before "
                "its step: use sync='eager'")
    return skip_on_device


def checks(**switches: Any) -> None:
    """Validates the watch's on/off options (inputs, activations, grads, params, modules, loss).

    Raises:
        TypeError: a switch that is not a bool (a string such as "no" would be true).
        ValueError: every check is off (inputs, activations, grads, params and loss): the watch would
            look at nothing, and its records would read as clean steps."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"nanfast.watch: {name} must be True or False, got {value!r}")
    looked_at = ("inputs", "activations", "grads", "params", "loss")
    if not any(switches[name] for name in looked_at):
        raise ValueError(f"nanfast.watch: {', '.join(looked_at)} are all False: the watch would check nothing, and a "
                         "step it did not look at must not read as clean; turn one of them on, or do not watch")


def typed_options(*, nan_only: Any, profile: Any, scaler: Any, process_group: Any,
                  pass_through: Any) -> tuple[type, ...]:
    """Validates the watch's options that are not checks: each of the kind it must be.

    Args:
        nan_only, profile, scaler, process_group, pass_through: as given to `nanfast.watch`.

    Returns:
        pass_through as a tuple of classes.

    Raises:
        TypeError: nan_only or profile not a bool, scaler not a GradScaler (scale, step and update), a
            process_group that is not one, pass_through not nn.Module classes."""
    for name, value in (("nan_only", nan_only), ("profile", profile)):
        if not isinstance(value, bool):
            raise TypeError(f"nanfast.watch: {name} must be True or False, got {value!r}")
    if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("scale", "step", "update")):
        raise TypeError(f"nanfast.watch: scaler must be a torch.amp.GradScaler (or None), got {type(scaler).__name__}")
    dist = torch.distributed
    if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(f"nanfast.watch: process_group must be a torch.distributed ProcessGroup (or None), got "
                        f"{type(process_group).__name__}")
    classes = tuple(pass_through) if isinstance(pass_through, Iterable) and not isinstance(pass_through, str) else None
    if classes is None or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        raise TypeError(f"nanfast.watch: pass_through must be nn.Module classes (a tuple), got {pass_through!r}")
    return classes


def rollback_options(action: Union[str, Callable], params: bool, every: Optional[int],
                     device: Optional[Union[str, torch.device]]) -> Optional[tuple[int, torch.device]]:
    """Checks the options of action="rollback" and fills in their defaults.

    Args:
        action, params: as given to `nanfast.watch`.
        every: ``rollback_every``, steps between snapshots (None: ROLLBACK_EVERY).
        device: ``rollback_device``, where the snapshots are kept (None: ROLLBACK_DEVICE).

    Returns:
        (every, device) for action="rollback"; None for any other action.

    Raises:
        ValueError: a value out of range, a rollback option given with another action, or
            action="rollback" with params=False (the check that finds non-finite parameters)."""
    if callable(action) or action != "rollback":
        for name, value in (("rollback_every", every), ("rollback_device", device)):
            if value is not None:
                raise ValueError(f"nanfast.watch: {name}= is an option of action='rollback' (got action={action!r})")
        return None
    if not params:
        raise ValueError("nanfast.watch: action='rollback' needs params=True: the parameters' check is what finds "
                         "them non-finite")
    every = steps_option("rollback_every", ROLLBACK_EVERY if every is None else every)
    device = ROLLBACK_DEVICE if device is None else device
    try:
        where = torch.device(device)
        torch.empty(0, device=where)  # a device this process can use: not a build or an index it lacks
    except (RuntimeError, TypeError, AssertionError) as error:
        raise ValueError(f"nanfast.watch: rollback_device must be a device this process can allocate on, such as "
                         f"'cpu' or 'cuda:0'; got {device!r} ({str(error).splitlines()[0]})") from None
    if where.type == "meta":
        raise ValueError("nanfast.watch: rollback_device='meta' holds no values to restore")
    return every, where


def results_device(model: torch.nn.Module) -> torch.device:
    """Where a watch's counts and summary live: the device of the model's first parameter on an
    accelerator if it has one (a model whose CPU embedding table comes before its GPU layers: counts
    copied to the CPU would have to be waited for, see NOTE: [Results copied to the CPU]), else of its
    first parameter, else the CPU.

    Args:
        model: the watched module.

    Returns:
        The device."""
    devices = [p.device for p in model.parameters()]
    accelerator = next((d for d in devices if d.type not in ("cpu", "meta")), None)
    return accelerator or (devices[0] if devices else torch.device("cpu"))


def fused_records(fuse: Optional[bool], device: torch.device) -> bool:
    """The ``fuse`` option with its default filled in.

    Args:
        fuse: as given to `nanfast.watch`: True, False or None (the default: by device).
        device: where the watch's results live (`results_device`).

    Returns:
        Whether module checks are deferred and fused (see NOTE: [Fused records] in
        csrc/python/watch_records.h).

    Raises:
        TypeError: fuse is not None or a bool."""
    # NOTE: [Fused records by default on accelerators]
    # On a GPU each module check made at once is a kernel launch and a round of host dispatch (~15 us of
    # host time per call on an H200's host), and a GPU step is bound by its host: watched that way,
    # ResNet-18's 6.7 ms step took +47%, a small transformer's 4.6 ms one +25%; fused, +18% and +16%
    # (H200, 2026-11-26; benchmarks/results/cuda-h200.md). On a CPU a check made at once reads the
    # tensor while it is still in cache, the cheaper way there. So a watch whose results live on an
    # accelerator fuses unless told otherwise; what that gives up is said at NOTE: [Fused records].
    if fuse is None:
        return device.type not in ("cpu", "meta")
    if not isinstance(fuse, bool):
        raise TypeError(f"nanfast.watch: fuse must be True, False or None (by device), got {fuse!r}")
    return fuse
