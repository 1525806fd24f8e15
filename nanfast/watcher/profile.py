"""Measuring what a watch costs (see NOTE: [Profiling the watch]): a watch made with profile=True times
its hooks and its fused pass, and its recorder times its kernels; `Watch.costs()` returns the totals.
A watch made without it wraps nothing and reads no clock."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch


class Profile:
    """The totals of a profiled watch kept on the Python side: seconds in its hooks and in its fused pass
    over parameters and gradients, the bytes that pass read and the number of its calls."""

    def __init__(self) -> None:
        self.seconds = {"hooks": 0.0, "pass": 0.0}
        self.pass_bytes = 0
        self.pass_calls = 0

    def timed(self, fn: Callable, key: str = "hooks") -> Callable:
        """`fn`, its time added to seconds[key] at each call."""
        is_compiling = torch.compiler.is_compiling

        @functools.wraps(fn)
        def timed_fn(*args: Any, **kwargs: Any) -> Any:
            # A hook traced by torch.compile does nothing (NOTE: [The watch and torch.compile]); a clock read
            # there broke the graph at every module of a profiled watch (a probe, session 46).
            if is_compiling():
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
        return timed_fn

    def counted_pass(self, stats_on: Callable) -> Callable:
        """The fused pass's op, timed, with its calls and the bytes it reads counted."""
        timed = self.timed(stats_on, "pass")

        def counted(tensors: list, device: Any) -> Any:
            self.pass_calls += 1
            self.pass_bytes += sum(t.numel() * t.element_size() for t in tensors)
            return timed(tensors, device)
        return counted

    def totals(self, recorder: Any, module_hooks: Any) -> dict[str, float]:
        """Everything so far, with the recorder's part (its kernel calls, its gradient checks) and the
        module hooks' (ModuleHooks.seconds), which run in C++ where no Python hook sees them."""
        kernel_s, grad_checks_s, recorded_bytes, recorded_calls = recorder.costs()
        return {"hooks": self.seconds["hooks"] + grad_checks_s + module_hooks.seconds,
                "kernels": self.seconds["pass"] + kernel_s,
                "bytes": self.pass_bytes + recorded_bytes, "calls": self.pass_calls + recorded_calls,
                "pass": self.seconds["pass"], "pass_bytes": self.pass_bytes}
