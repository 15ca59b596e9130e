"""A filesystem that takes no more writes (full, over quota, read-only) in the middle of a run: one line and exit
status 3 (``hydratrain.errors.OutputError``), not logging's traceback block per record, TensorBoard's writer-thread
traceback and the library's traceback at the next write. (A failed checkpoint save: test_checkpoint_io.py.)"""
from __future__ import annotations

import errno
import json
import logging
import os
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import cut_command
from hydratrain.errors import unwritable_cause


def _full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def test_the_cause_is_found_through_the_chain_and_only_for_errnos_of_a_full_or_read_only_filesystem():
    try:
        try:
            raise _full()
        except OSError as inner:
            raise RuntimeError("the library's own error") from inner
    except RuntimeError as outer:
        assert unwritable_cause(outer).errno == errno.ENOSPC
    assert unwritable_cause(OSError(errno.EROFS, "Read-only file system")) is not None
    assert unwritable_cause(FileNotFoundError(errno.ENOENT, "No such file")) is None  # a bad path is not a full disk
    assert unwritable_cause(ValueError("x")) is None
    # a library's own error type that only quotes the errno (safetensors on a full disk)
    quoted = unwritable_cause(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert quoted is not None and quoted.errno == errno.ENOSPC


@pytest.fixture(autouse=True)
def _roomy(monkeypatch):
    """Every dir has 100 GB free unless a test says otherwise: what a message tells from the free space (a likely
    ENOSPC under 1 GiB) must not depend on the disk of the machine that runs the tests."""
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(
        total=200 * 10**9, used=100 * 10**9, free=100 * 10**9))


def _file_size_limit(monkeypatch, limit):
    """This process's RLIMIT_FSIZE as hydratrain.errors reads it: ``limit`` bytes (None: unlimited)."""
    import resource

    getrlimit = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (resource.RLIM_INFINITY if limit is None else limit, resource.RLIM_INFINITY)
        if which == resource.RLIMIT_FSIZE else getrlimit(which)))


def test_the_advice_fits_the_errno(tmp_path, monkeypatch):
    from hydratrain.dist.launch import unwritable_message

    read_only = unwritable_message("writing x", tmp_path, OSError(errno.EROFS, "Read-only file system"), None,
                                   stopped="the run stopped")
    assert cut_command(read_only)[0].endswith("the run stopped. No checkpoint was written before: make it writable "
                                              "(or write elsewhere) and relaunch"), read_only
    named = unwritable_message("writing x", tmp_path, _full(), None, run_dir=tmp_path / "run dir, 1")
    assert cut_command(named)[1].endswith(f" \"hydra.run.dir='{tmp_path}/run dir, 1'\""), named  # read back as given
    assert "make room" in unwritable_message("saving step 2", tmp_path, _full(), tmp_path / "step_00000001")


@pytest.mark.parametrize("code, remedy", [
    (errno.ENOSPC, "make room (or lower checkpoint.keep_last)"),
    (errno.EDQUOT, "free some of your quota (or lower checkpoint.keep_last)"),
    (errno.EROFS, "make it writable (or write elsewhere)"),
    (errno.EACCES, "fix the permissions of {dir} (or write elsewhere)"),
    (errno.EPERM, "fix the permissions or attributes (lsattr -d) of {dir} (or write elsewhere)"),
    (errno.EFBIG, "raise the file-size limit (`ulimit -f`, in the shell or job script that launches the run)"),
])
def test_each_cause_gets_its_own_remedy(tmp_path, monkeypatch, code, remedy):
    """Every errno but EROFS and EDQUOT was told to "make room", a file-size limit (``ulimit -f``,
    EFBIG) with 43 GB free and a dir made unwritable (``chmod a-w``: EACCES, ``chattr +i``: EPERM) alike. A
    permission error names the dir that refused (the one the new file was to be made in); a file-size limit gives
    its value."""
    from hydratrain.dist.launch import unwritable_message

    _file_size_limit(monkeypatch, 1000 * 1024)
    refused = tmp_path / "checkpoints"
    refused.mkdir()
    cause = OSError(code, os.strerror(code), str(refused / ".tmp-step_00000004"))
    message = unwritable_message("saving step 4", refused, cause, refused / "step_00000002",
                                 frees="lower checkpoint.keep_last")
    assert cut_command(message)[0].endswith(f"is intact: {remedy.format(dir=refused)} and resume from it with"), message
    assert ("MB free there" in message) == (code in (errno.ENOSPC, errno.EDQUOT)), message  # only where it tells
    if code == errno.EFBIG:
        assert "this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) is 1000 KiB)" in message, message


def test_an_error_that_lost_its_errno_is_told_from_the_dir(tmp_path, monkeypatch):
    """Torch's checkpoint writer raises ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos
    ...`` on a failed write, without the errno: the line was "make room" with 43 GB free under ``ulimit -f``. The
    likely cause comes from the dir (a file-size limit, a dir this process may not write, little free space), else
    the cause is said to be unknown, with the error's text."""
    import shutil

    from hydratrain.dist.launch import unwritable_message

    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    def message():
        return unwritable_message("saving step 2", tmp_path, lost, None, frees="lower checkpoint.keep_last")

    _file_size_limit(monkeypatch, None)
    unknown = message()
    assert unknown.startswith(f"saving step 2 under {tmp_path} failed (RuntimeError: [enforce fail at "
                              "inline_container.cc:672] . unexpected pos 704 vs 598; the cause is unknown: the error "
                              f"has no errno, and {tmp_path} is writable, with "), unknown
    assert cut_command(unknown)[0].endswith("MB free there and no file-size limit); training stopped. No checkpoint "
                                            "was written before: find and fix what refused the write (the error "
                                            "above) and relaunch"), unknown
    _file_size_limit(monkeypatch, 1000 * 1024)
    assert ("(RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598; the error has no "
            "errno; likely File too large: this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) is 1000 KiB); "
            "training stopped. No checkpoint was written before: raise the file-size limit") in message(), message()
    _file_size_limit(monkeypatch, None)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: mode != os.W_OK and access(path, mode, **k))
    assert cut_command(message())[0].endswith("; the error has no errno; likely Permission denied); training "
                                              "stopped. No checkpoint was written before: fix the permissions of "
                                              f"{tmp_path} (or write elsewhere) and relaunch"), message()
    statvfs = os.statvfs
    fields = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail", "f_namemax")
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(
        f_flag=os.ST_RDONLY, **{k: getattr(statvfs(path), k) for k in fields}))
    assert "likely Read-only file system); training stopped. No checkpoint was written before: make it writable" in (
        message()), message()
    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(
        total=200 * 10**9, used=200 * 10**9 - 2_000_000, free=2_000_000))
    assert cut_command(message())[0].endswith("; the error has no errno; likely No space left on device: 2.0 MB free "
                                              "there); training stopped. No checkpoint was written before: make room "
                                              "(or lower checkpoint.keep_last) and relaunch"), message()


def test_a_permission_error_is_an_unwritable_output_only_where_the_run_writes(tmp_path, monkeypatch):
    """EACCES / EPERM (a TensorBoard dir made unwritable mid-run: not a traceback and exit 1) count
    for the dirs the run writes (in, below, or above them: a dir made on the way), not for another path, nor for a
    file there that this process may not read (a read of an input): those keep their own report."""
    run_dir = tmp_path / "runs" / "a"

    def denied(path, code=errno.EACCES):
        return PermissionError(code, os.strerror(code), str(path))

    assert unwritable_cause(denied(run_dir / "tensorboard" / "hparams"), writes=(run_dir,)) is not None
    assert unwritable_cause(denied(run_dir / "checkpoints" / ".tmp-step_00000004", errno.EPERM),
                            writes=(run_dir,)).errno == errno.EPERM
    assert unwritable_cause(denied(tmp_path / "runs"), writes=(run_dir,)) is not None  # makedirs on the way
    assert unwritable_cause(denied(run_dir / "tensorboard" / "hparams")) is None  # a write no caller vouched for
    assert unwritable_cause(denied(tmp_path / "data" / "train.txt"), writes=(run_dir,)) is None  # an input
    assert unwritable_cause(RuntimeError("could not open x: Permission denied"), writes=(run_dir,)) is None
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text("{}")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: mode != os.R_OK and access(path, mode, **k))
    assert unwritable_cause(denied(run_dir / "results.json"), writes=(run_dir,)) is None  # reading it was refused


def test_a_console_that_is_gone_is_reported_once_and_dropped(capsys):
    """``train.py ... | head -2``: once head had left, every log record printed logging's 30-line ``--- Logging error
    --- ... BrokenPipeError`` block on stderr (642 lines for an 8-step run), burying the one-line errors there.
    The console handler says it once and drops the rest; a console that works is unchanged."""
    import errno
    import io

    from hydratrain.dist.env import RunConsoleHandler

    class GonePipe(io.StringIO):
        def write(self, _):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    logger = logging.getLogger("test_full_disk.console")
    logger.propagate = False
    works, gone = RunConsoleHandler(io.StringIO()), RunConsoleHandler(GonePipe())
    logger.addHandler(works)
    logger.addHandler(gone)
    try:
        for i in range(3):
            logger.warning("line %d", i)
    finally:
        logger.removeHandler(works)
        logger.removeHandler(gone)
    err = capsys.readouterr().err
    assert err == ("hydratrain: writing to the console failed (BrokenPipeError: [Errno 32] Broken pipe); its lines "
                   "go to the log file only from now on\n"), err
    assert works.stream.getvalue() == "line 0\nline 1\nline 2\n"


def test_a_log_file_that_cannot_be_written_is_reported_once_and_dropped(tmp_path, capsys):
    from hydratrain.dist.env import RunLogFileHandler

    handler = RunLogFileHandler(str(tmp_path / "train_rank0.log"))

    class FullStream:
        def write(self, _):
            raise _full()

        def flush(self):
            raise _full()

    handler.stream.close()
    handler.stream = FullStream()
    logger = logging.getLogger("test_full_disk")
    logger.addHandler(handler)
    try:
        for i in range(3):
            logger.warning("line %d", i)
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"hydratrain: writing the log file {tmp_path / 'train_rank0.log'} failed (OSError: "
                                "[Errno 28] No space left on device); its lines go to the console only from now on"]


def test_tensorboards_writer_thread_fails_quietly_and_the_next_write_raises(tmp_path, capfd):
    from hydratrain.metrics import TensorBoardLogger

    tb = TensorBoardLogger(tmp_path / "tensorboard", enabled=True)
    tb.scalars({"train/loss": 1.0}, 1)
    tb.flush()
    records = tb.writer.file_writer.event_writer._async_writer._writer

    def refuse(_):
        raise _full()

    records.write = refuse
    with pytest.raises(OSError) as raised:
        for step in range(2, 50):  # the thread fails on the first write after the patch; a later call raises it
            tb.scalars({"train/loss": 1.0}, step)
            tb.flush()
    assert raised.value.errno == errno.ENOSPC
    assert "Traceback" not in capfd.readouterr().err  # the thread's own traceback is not printed


def test_a_full_disk_mid_run_ends_it_with_one_line_and_status_3(cli, tmp_path, monkeypatch):
    from hydratrain.metrics import TensorBoardLogger

    scalars = TensorBoardLogger.scalars

    def full_from_step_3(self, values, step):
        if step >= 3:
            raise _full()
        scalars(self, values, step)

    monkeypatch.setattr(TensorBoardLogger, "scalars", full_from_step_3)
    run = cli(["strategy=single", "trainer.max_steps=6", "checkpoint.every_n_steps=2", "trainer.log_every_n_steps=1",
               "trainer.eval_every_n_steps=0"], tmp_path / "r")
    assert run.returncode == 3, run.output[-3000:]
    lines = [ln for ln in run.output.splitlines() if ln.startswith("hydratrain: output error:")]
    assert lines == [f"hydratrain: output error: writing the run's outputs under {tmp_path / 'r'} failed (OSError: "
                     f"[Errno 28] No space left on device; " + lines[0].split("; ", 1)[1]], run.output[-3000:]
    assert f"The latest complete checkpoint, {tmp_path / 'r' / 'checkpoints' / 'step_00000002'}, is intact" in lines[0]
    assert "Traceback" not in run.output


def test_a_run_dir_that_takes_no_writes_ends_the_start_with_one_line_and_status_3(tmp_path, monkeypatch, capsys):
    """Hydra's copy of the config (``.hydra/``) was the first write to the run dir, and a full disk there gave
    Hydra's traceback and exit 1 (the relaunch after "make room" when too little was freed). The ``output_subdir``
    resolver probes the dir first; a checkpoint already there is named for the resume."""
    import hydratrain.dist.run_dir as run_dir

    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    monkeypatch.setattr(run_dir, "latest_checkpoint", lambda root: root / "step_00000004")  # (imported from layout)

    def full(path, mode="r", *a, **k):
        raise _full()

    monkeypatch.setattr(run_dir, "open", full, raising=False)
    with pytest.raises(SystemExit) as exit_:
        run_dir.refuse_a_full_run_dir(tmp_path)
    assert exit_.value.code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hydratrain: output error: writing the run dir under {tmp_path} "
                                                    "failed (OSError: [Errno 28] No space left on device;"), err
    assert "the run did not start. The latest complete checkpoint, " in err and "step_00000004, is intact" in err
    with pytest.raises(SystemExit):  # a sweep's dir, before Hydra's multirun.yaml: which checkpoint is not its to say
        run_dir.refuse_a_full_run_dir(tmp_path / "sweep", sweep=True)
    head, command = cut_command(capsys.readouterr().err)
    assert head.endswith("the sweep did not start. Make room and relaunch") and command.endswith(
        f"hydra.sweep.dir={tmp_path / 'sweep'}"), (head, command)
    monkeypatch.undo()
    run_dir.refuse_a_full_run_dir(tmp_path)  # a writable dir: nothing said, nothing left behind
    assert capsys.readouterr().err == "" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "sweep"]


def test_a_tensorboard_dir_that_refuses_by_permission_ends_with_one_line_and_results_json_is_written(
        cli, tmp_path, monkeypatch):
    """``chmod a-w <run>/tensorboard`` (or ``chattr +i``) mid-run: the hparams row's writer could
    not make its dir, and the run ended in a 30-line traceback, exit 1, without results.json (written after the
    hparams row) although the run dir took writes. Now: the output-error line naming the TensorBoard dir and how to
    fix it, exit 3, and results.json, the run's figures, written."""
    run_dir = tmp_path / "r"
    refused = run_dir / "tensorboard" / "hparams"
    makedirs = os.makedirs

    def denied(name, *args, **kwargs):  # what a dir without write permission answers (this test may run as root)
        if os.path.abspath(name).startswith(str(refused)):
            raise PermissionError(errno.EACCES, "Permission denied", str(refused))
        return makedirs(name, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", denied)
    run = cli(["strategy=single", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "trainer.eval_every_n_steps=0"],
              run_dir)
    assert run.returncode == 3, run.output[-3000:]
    assert "Traceback" not in run.output, run.output[-3000:]
    lines = [ln for ln in run.output.splitlines() if ln.startswith("hydratrain: ")]
    assert lines == [f"hydratrain: output error: writing TensorBoard events under {run_dir / 'tensorboard'} failed "
                     "(PermissionError: [Errno 13] Permission denied); the run stopped. The latest complete "
                     f"checkpoint, {run_dir / 'checkpoints' / 'step_00000004'}, is intact: fix the permissions of "
                     f"{run_dir / 'tensorboard'} (or write elsewhere) and resume from it with: {' '.join(run.cmd)}"]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 4 and results["train_loss"] is not None


def test_a_permission_error_reading_an_input_is_not_an_output_error(cli, tmp_path, monkeypatch):
    """The other side of EACCES counting as an output that cannot be written: an input that cannot be read (a text
    file of the corpus) is not reported as "writing the data cache ... failed"."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    read_bytes = Path.read_bytes

    def unreadable(self):  # what a file without read permission answers (this test may run as root)
        if str(self).startswith(str(data)):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    run = cli(["strategy=single", "trainer.max_steps=2", "data=text_files", f"data.paths=[{data}/a.txt]"],
              tmp_path / "r")
    assert run.returncode != 3 and "output error" not in run.output, run.output[-3000:]
    assert "Permission denied" in run.output, run.output[-3000:]


def test_a_run_dir_that_cannot_be_made_ends_the_start_with_one_line_before_hydra_makes_it(cli, tmp_path,
                                                                                          monkeypatch):
    """A new ``hydra.run.dir`` under a read-only mount was Hydra's traceback from its ``mkdir`` and
    exit 1 (the write probe came after, when Hydra resolves ``hydra.output_subdir``). The run's start callback
    probes first: one line, exit status 3, nothing of Hydra's."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mkdir = Path.mkdir

    def refused(self, *args, **kwargs):  # what a read-only filesystem answers (a mount needs root)
        if str(self.absolute()).startswith(str(read_only)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    run = cli(["strategy=single", "trainer.max_steps=2"], read_only / "new")
    assert run.returncode == 3, run.output[-3000:]
    assert run.output.strip().splitlines() == [
        f"hydratrain: output error: writing the run dir under {read_only / 'new'} failed (OSError: [Errno 30] "
        f"Read-only file system: '{read_only / 'new'}'); the run did not start. No checkpoint was written before: "
        f"make it writable (or write elsewhere) and relaunch: {' '.join(run.cmd)}"], run.output[-3000:]


def _without_dac_override() -> list:
    """``setpriv`` that runs a command as root without CAP_DAC_OVERRIDE, so that a dir's permissions refuse it as
    they refuse any other user; skips the test where that cannot be done (no setpriv, no root, a container that
    refuses it)."""
    import shutil
    import subprocess
    import tempfile

    nocap = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs setpriv and root to emulate a user without write permission")
    with tempfile.TemporaryDirectory() as scratch:
        os.chmod(scratch, 0o555)
        probe = subprocess.run([*nocap, "touch", os.path.join(scratch, "x")], capture_output=True)
        os.chmod(scratch, 0o755)
    if probe.returncode == 0:
        pytest.skip("setpriv could not drop CAP_DAC_OVERRIDE here")
    return nocap


def test_a_run_or_sweep_dir_without_write_permission_ends_the_start_with_one_line(tmp_path):
    """As a user without write permission (``chmod 555``), an existing run dir (to resume) was
    Hydra's traceback from opening ``train_rank0.log`` there, a new dir under it Hydra's traceback from its
    ``mkdir``, and a sweep dir under it a traceback from ``multirun.yaml``: exit 1 each. Now exit 3 and one line
    naming the dir whose permissions refused and that they must be fixed."""
    from helpers import command, finish, spawn

    nocap = _without_dac_override()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    cases = (([f"hydra.run.dir={locked}"], locked, "run"),
             ([f"hydra.run.dir={locked / 'new'}"], locked / "new", "run"),
             (["-m", f"hydra.sweep.dir={locked / 'sweep'}"], locked / "sweep", "sweep"))
    try:  # the three launches at once (each stops in its start-up): one process start-up's wait, not three
        procs = [spawn([*nocap, *command(["strategy=single", "trainer.max_steps=2", *args])]) for args, _, _ in cases]
        for proc, (args, dir_, kind) in zip(procs, cases):
            run = finish(proc, timeout=120)
            assert run.returncode == 3, run.output[-3000:]
            lines = run.output.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(
                f"hydratrain: output error: writing the {kind} dir under {dir_} failed (PermissionError: [Errno 13] "
                "Permission denied: "), run.output[-3000:]
            remedy = f"fix the permissions of {locked} (or write elsewhere) and relaunch"
            head, resume = cut_command(lines[0])
            assert head.endswith(f"; the {kind} did not start. " + (
                f"No checkpoint was written before: {remedy}" if kind == "run" else f"F{remedy[1:]}")), lines[0]
            assert resume == shlex.join(run.cmd[len(nocap):-1] + [args[-1]]), (resume, run.cmd)
        assert sorted(p.name for p in locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


@pytest.mark.slow  # a torchrun launch of 2 ranks (about 30 s on 2 busy cores)
def test_a_run_dir_without_write_permission_under_torchrun_ends_every_rank_with_status_3(tmp_path):
    """Under torchrun: every rank probes the run dir before Hydra opens its log file there; rank 0
    says the one line and leaves first with status 3 (the agent's root cause), the others say nothing."""
    import re

    from helpers import command, sh

    nocap = _without_dac_override()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        run = sh([*nocap, *command(["strategy=ddp", "trainer.max_steps=2", f"hydra.run.dir={locked}"], nproc=2)],
                 timeout=180)
    finally:
        locked.chmod(0o755)
    assert run.returncode != 0
    lines = [ln for ln in run.output.splitlines() if ln.startswith("hydratrain:")]
    assert len(lines) == 1 and lines[0].startswith(f"hydratrain: output error: writing the run dir under {locked} "
                                                   "failed (PermissionError: [Errno 13] Permission denied: "), (
        run.output[-3000:])
    root = run.output.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 3 ", root), run.output[-3000:]
    assert "train_rank0.log" not in run.output and list(locked.iterdir()) == []


def test_a_compile_cache_that_takes_no_writes_is_named_not_the_run_dir(tmp_path, monkeypatch):
    """torch.compile's cache on a read-only mount (``TORCHINDUCTOR_CACHE_DIR``) ended the run with "writing the
    run's outputs under <run dir> failed (... Read-only file system ...)": the run dir was writable, and the cache was
    named nowhere. The error from inductor's code names its cache and how to move it."""
    import errno
    import sys
    import types

    from hydratrain.errors import OutputError
    from hydratrain.train.outputs import unwritable_as_output_error

    cache = tmp_path / "inductor"
    monkeypatch.setitem(sys.modules, "torch._inductor.runtime.cache_dir_utils",
                        types.SimpleNamespace(cache_dir=lambda: str(cache)))
    code = compile("def codegen():\n    raise RuntimeError('InductorError: OSError: [Errno 30] Read-only file "
                   "system')\n", "/site-packages/torch/_inductor/codecache.py", "exec")
    inductor = {}
    exec(code, inductor)  # a frame whose file is inductor's, as in a real compile
    with pytest.raises(OutputError) as raised:
        with unwritable_as_output_error(tmp_path / "run", None, tmp_path / "data-cache"):
            inductor["codegen"]()
    line = str(raised.value)
    assert line.startswith(f"writing torch.compile's cache (trainer.compile=true) under {cache} failed "
                           f"(OSError: [Errno {errno.EROFS}] Read-only file system"), line
    assert "set TORCHINDUCTOR_CACHE_DIR to a dir this process can write (or trainer.compile=false)" in line
