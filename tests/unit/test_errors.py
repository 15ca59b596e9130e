"""Every exception class of hydratrain and its launcher plugin survives pickling (submitit and Ray pickle a job's
exception back to the launching process): same type, message, args and attributes. The classes are discovered by
importing every module, so a new one is covered without editing this file."""
from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import hydra_plugins.hydratrain_launcher
import hydratrain

PACKAGES = (hydratrain, hydra_plugins.hydratrain_launcher)


def _exception_classes() -> list:
    found = set()
    for pkg in PACKAGES:
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__.startswith(tuple(p.__name__ for p in PACKAGES)):
                    found.add(cls)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _sample(param: inspect.Parameter):
    """A value for one constructor parameter, of the annotated kind (annotations are strings here)."""
    kind = str(param.annotation)
    return 7 if "int" in kind else 2.5 if "float" in kind else f"<{param.name}>"


def _instance(cls) -> BaseException:
    """``cls`` built with a value for every parameter of its ``__init__`` (optional ones too, so that every
    attribute is set), or with one message when it keeps the built-in one."""
    if not inspect.isfunction(cls.__init__):
        return cls("<message>")
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return cls(*(_sample(p) for p in params))


CLASSES = _exception_classes()


def test_discovery_finds_the_classes_with_constructor_arguments():
    names = {c.__name__ for c in CLASSES}
    assert {"ConfigError", "DivergenceError", "PeerFailedError", "LauncherConfigError", "LaunchError"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_exception_round_trips_through_pickle(cls):
    err = _instance(cls)
    err.add_note("a note")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(back) is cls
        assert str(back) == str(err) and back.args == err.args
        assert vars(back) == vars(err)  # key, value, why, step, last_checkpoint, linger_s, __notes__


def test_config_error_keeps_its_key_and_exit_status_through_pickle():
    from hydratrain.errors import EXIT_CONFIG, ConfigError

    back = pickle.loads(pickle.dumps(ConfigError("optim.lr", -1.0, "must be finite and > 0")))
    assert (back.key, back.value, back.exit_status, back.label) == ("optim.lr", -1.0, EXIT_CONFIG, "config error")
    assert str(back) == "optim.lr=-1.0: must be finite and > 0"


def test_every_stderr_line_of_ours_is_one_write(monkeypatch):
    """print(..., file=sys.stderr) wrote the text and its newline in two writes; in a log that several processes
    share, another process's line was glued onto the end of a 'hydratrain: ...' line. No module of ours
    prints to stderr any other way."""
    import ast
    import sys
    from pathlib import Path

    from hydratrain.errors import say

    writes = []
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": lambda self, s: writes.append(s),
                                                             "flush": lambda self: None})())
    say("hydratrain: config error:", "x=1: why")
    assert writes == ["hydratrain: config error: x=1: why\n"]
    src = Path(__file__).resolve().parents[2] / "src"
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                assert not any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords), \
                    f"{path}:{node.lineno}: print to stderr; use hydratrain.errors.say"


def test_a_rank_waits_for_the_rank_that_failed_to_say_it_is_exiting():
    """Rank 0 ran out of memory and took more than the fixed 3 s to tear down after its line (a 3 GiB step, a loaded
    machine): rank 1 left first with status 5, torchrun named it the root cause and rank 0 showed -15, its status 6
    lost. A peer now waits until the rank that recorded the failure marks itself exiting (bounded
    by half of distributed.failure_timeout_s); a failure it did not record itself (a killed rank) keeps the 3 s."""
    import threading
    import time

    from hydratrain.dist.process_group import FailureWatch

    class Store:
        def __init__(self, after_s):
            self.at = time.monotonic() + after_s

        def check(self, keys):
            assert keys == ["exiting/0"]
            return time.monotonic() >= self.at

    watch = object.__new__(FailureWatch)
    watch.rank, watch.linger_s, watch._timeout_s, watch._stop = 1, 0.2, 60.0, threading.Event()
    started = time.monotonic()
    assert watch._leave_after(Store(1.0), "rank 0: OutOfMemoryError: out of memory") is False
    assert 1.9 < time.monotonic() - started < 4.0  # its mark at 1 s, then a second more (not the 0.2 s linger)
    watch.linger_s = 3.0  # a mark that comes early: still the linger in all
    started = time.monotonic()
    assert watch._leave_after(Store(0.0), "rank 0: OutOfMemoryError: out of memory") is False
    assert 2.9 < time.monotonic() - started < 4.5
    watch.linger_s = 0.2
    started = time.monotonic()
    assert watch._leave_after(Store(99.0), "rank 0 stopped responding (no heartbeat for 31 s)") is False
    assert time.monotonic() - started < 1.0  # not recorded by rank 0 itself: the linger alone
    watch._timeout_s = 1.0  # a rank that never marks: at most half of failure_timeout_s
    started = time.monotonic()
    assert watch._leave_after(Store(99.0), "rank 0: RuntimeError: boom") is False
    assert time.monotonic() - started < 2.0


def test_the_resume_command_comes_from_rank_1_when_rank_0_is_the_rank_that_failed():
    """A killed (out-of-memory) rank 0 says nothing more: the survivor's line carries the command that resumes."""
    from types import SimpleNamespace

    from hydratrain.dist.process_group import PeerFailedError
    from hydratrain.exits import _says_how_to_resume

    zero = PeerFailedError("another rank failed first (rank 0 stopped responding (no heartbeat for 3.0 s)); ...")
    one = PeerFailedError("another rank failed first (rank 1: RuntimeError: boom); this rank lost it")
    ranks = [SimpleNamespace(rank=r, world_size=2) for r in (0, 1)]
    assert [_says_how_to_resume(zero, env) for env in ranks] == [False, True]
    assert [_says_how_to_resume(one, env) for env in ranks] == [True, False]
