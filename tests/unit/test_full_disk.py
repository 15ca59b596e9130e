"""A filesystem that takes no more writes (full, over quota, read-only) in the middle of a run: one line and exit
status 3 (``hydratrain.errors.OutputError``), not logging's traceback block per record, TensorBoard's writer-thread
traceback and the library's traceback at the next write. (A failed checkpoint save: test_checkpoint_io.py.)"""
from __future__ import annotations

import errno
import logging

import pytest

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


def test_the_advice_fits_the_errno(tmp_path):
    from hydratrain.errors import unwritable_message

    read_only = unwritable_message("writing x", tmp_path, OSError(errno.EROFS, "Read-only file system"), None,
                                   stopped="the run stopped")
    assert read_only.endswith("the run stopped. No checkpoint was written before: make it writable (or write "
                              "elsewhere) and relaunch"), read_only
    assert "make room" in unwritable_message("saving step 2", tmp_path, _full(), tmp_path / "step_00000001")


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
    monkeypatch.setattr("hydratrain.checkpoint.manager.latest_checkpoint", lambda root: root / "step_00000004")

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
    assert capsys.readouterr().err.endswith("the sweep did not start. Make room and relaunch the same command\n")
    monkeypatch.undo()
    run_dir.refuse_a_full_run_dir(tmp_path)  # a writable dir: nothing said, nothing left behind
    assert capsys.readouterr().err == "" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "sweep"]
