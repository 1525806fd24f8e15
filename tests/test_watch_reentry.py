"""A watched model called again where the watch did not expect it (session 44's probe of copies, threads and
re-entrancy): a forward stopped by Ctrl-C, a callable action that runs the model, a `with` block entered
twice, threads sharing one watched model, copies of a watched GradScaler and of watched submodules."""

import copy
import pickle
import threading

import pytest
import torch

import nanfast

NAN = float("nan")


class Interrupts(torch.nn.Module):
    """Raises `exc` in its forward while set."""

    exc = None

    def forward(self, x):
        if Interrupts.exc is not None:
            raise Interrupts.exc
        return x


class Explodes(torch.nn.Module):
    on = False

    def forward(self, x):
        return x * float("inf") if Explodes.on else x


@pytest.mark.parametrize("exc", [RuntimeError("out of memory"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_forward_stopped_by_ctrl_c_is_forgotten_as_one_that_raised(exc):
    """torch's always_call hooks do not run for a KeyboardInterrupt: the interrupted forward's inf stayed
    in the step, and the healthy steps after it raised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), Explodes(), torch.nn.Tanh(), Interrupts(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    with nanfast.watch(model, opt, action="raise") as w:
        step()
        Explodes.on, Interrupts.exc = True, exc
        try:
            with pytest.raises(type(exc)):
                step()
        finally:
            Explodes.on, Interrupts.exc = False, None
        step()
        step()
        assert w.events == [] and w.step_count == 3


class CallsItself(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, depth=2):
        return self.lin(x) if depth == 0 else self(self.lin(x), depth - 1)


def test_a_model_calling_itself_is_one_forward_and_still_finds_a_fault():
    model = CallsItself()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="skip") as w, pytest.warns(RuntimeWarning, match="skipped"):
        for i in range(3):
            x = torch.randn(2, 4)
            if i == 1:
                x[0, 0] = NAN
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert [e.step for e in w.events] == [1] and w.skipped_steps == 1


def test_a_callable_action_that_runs_the_model_is_called_once():
    """Its forward was a bad step of its own, which called it again, without end (RecursionError)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).eval()
    calls = []

    def look_again(event):
        calls.append(event.step)
        with torch.no_grad():
            model(bad)  # the same bad batch, to look at the activations

    bad = torch.randn(2, 4)
    bad[0, 0] = NAN
    with nanfast.watch(model, action=look_again) as w, torch.no_grad():
        model(torch.randn(2, 4))
        model(bad)
        model(torch.randn(2, 4))
    assert calls == [1] and [e.step for e in w.events] == [1] and w.step_count == 3


def test_a_with_block_entered_twice_is_refused():
    """The inner block's end removed the watch: the rest of the outer block checked nothing."""
    model = torch.nn.Linear(4, 1)
    with nanfast.watch(model) as w:
        with pytest.raises(RuntimeError, match="already open"):
            with w:
                pass
        assert "installed" in repr(w)


def test_one_watched_model_called_from_several_threads_at_once_is_refused_clearly():
    """A thread pool serving one watched model: healthy calls raised over another thread's bad batch, an
    IndexError escaped a hook, modules were named with call numbers they never had."""
    entered, release = threading.Event(), threading.Event()

    class Waits(torch.nn.Module):
        def forward(self, x):
            if threading.current_thread().name == "first":
                entered.set()
                release.wait(10)
            return x

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Waits(), torch.nn.Linear(4, 1)).eval()
    errors = {}

    def serve():
        try:
            with torch.no_grad():
                model(torch.randn(2, 4))
        except Exception as e:  # noqa: BLE001
            errors[threading.current_thread().name] = e

    with nanfast.watch(model, action="raise") as w:
        first = threading.Thread(target=serve, name="first")
        first.start()
        assert entered.wait(10)
        second = threading.Thread(target=serve, name="second")
        second.start()
        second.join(10)
        release.set()
        first.join(10)
        assert list(errors) == ["second"]
        assert "called in thread second while its forward in thread first was running" in str(errors["second"])
        with torch.no_grad():  # one after another, from any thread: fine
            serve()
            model(torch.randn(2, 4))
        assert list(errors) == ["second"] and w.events == [] and w.step_count == 3


def test_a_deep_copied_grad_scaler_steps_as_itself():
    """Its step, copied from the watched scaler's wrapper, unscaled with the original scaler and failed
    ("No inf checks were recorded prior to update")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x = torch.randn(8, 4)

    def step(s):
        opt.zero_grad()
        s.scale(model(x).pow(2).mean()).backward()
        s.step(opt)
        s.update()

    with nanfast.watch(model, opt, scaler=scaler, action="skip"):
        step(scaler)
        copied = copy.deepcopy(scaler)
        step(copied)
        step(scaler)


def test_remove_takes_out_the_inert_hooks_of_copied_submodules():
    """A submodule deep-copied while watched and set back into the model kept its inert hooks after
    remove(): the model's pickle needed nanfast, and every later copy carried them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    hooks = [(m, dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()]
    w = nanfast.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[2] = copy.deepcopy(model[2])
    model(torch.randn(2, 4)).sum().backward()
    w.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(dict(m._forward_hooks) == f and dict(m._forward_pre_hooks) == p for m, f, p in hooks if m is not model[2])
    assert b"nanfast" not in pickle.dumps(model)
