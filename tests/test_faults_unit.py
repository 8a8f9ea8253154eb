"""The books and the rules of issue 24, without ranks: the ledger (goodput, restarts, lost steps), failure
records and which one is the cause, the restart verdict (what restarts, what ends the run, the count in a
row that a new checkpoint resets, crash loops), the rank-side heartbeat, straggler arithmetic, and what the
Slurm batch script asks between job steps."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launchers import slurm_restart
from launchers.local import summary_line
from trainer.run import failure, ledger, restart
from trainer.run.heartbeat import Heartbeat
from trainer.run.status import RunStatus, read_status


def commit(ckpt: Path, step: int) -> None:
    """A committed checkpoint directory, as far as the restart rules look (its COMMITTED marker)."""
    (ckpt / f"step-{step:08d}").mkdir(parents=True)
    (ckpt / f"step-{step:08d}" / "COMMITTED").write_text("{}")


def fail(run_dir: Path, rank: int, step: int | None, error: str, kind: str = failure.ERROR) -> None:
    failure.record(run_dir, rank, step, "step", kind, error)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------- the ledger

def test_goodput_counts_steps_that_count_over_the_wall_time_of_every_stretch():
    books = ledger.Ledger(session_start=100.0, wall_before_s=30.0, useful_s=45.0)
    assert books.wall_s(160.0) == 90.0 and books.goodput(160.0) == pytest.approx(0.5)
    books.end_session(160.0)  # a person stopped it: the clock stops until the next start
    assert books.wall_s(10_000.0) == 90.0 and books.session_start is None and not books.open
    assert ledger.Ledger().goodput(5.0) is None  # nothing ran yet


def test_a_restart_resumes_the_useful_seconds_of_its_checkpoint():
    books = ledger.Ledger()
    for step in (5, 10, 15):
        books.remember_save(step, step * 2.0)
    assert books.resume_point(10, 13, 26.5) == 20.0  # recorded at the save
    assert books.resume_point(13, 13, 26.5) == 26.5  # a clean stop: nothing lost
    assert books.resume_point(0, 13, 26.5) == 0.0
    assert books.resume_point(12, 16, 32.0) == pytest.approx(24.0)  # not recorded: in proportion
    for step in range(20, 20 + ledger.KEEP_SAVES + 5):
        books.remember_save(step, 1.0)
    assert len(books.saves) == ledger.KEEP_SAVES and 5 not in books.saves


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"restarts": "many", "useful_s": "NaN", "open": 1}',
                                  '{"saves": {"x": 1, "5": "y"}, "straggler": {"rank": "one"}}'])
def test_a_broken_ledger_reads_as_a_fresh_one(tmp_path, text):
    (tmp_path / ledger.LEDGER).write_text(text)
    books = ledger.load(tmp_path)
    assert books.restarts == 0 and books.useful_s == 0.0 and not books.open and books.straggler is None
    assert all(isinstance(k, int) for k in books.saves)


def test_progress_is_one_line_rewritten_in_place(tmp_path):
    progress = ledger.Progress(tmp_path)
    progress.write(9, 1.5)
    progress.write(10, 123456.25)
    progress.close()
    assert ledger.read_progress(tmp_path) == (10, 123456.25)
    assert (tmp_path / ledger.PROGRESS).read_text().count("\n") == 1
    assert ledger.read_progress(tmp_path / "nowhere") is None


# ---------------------------------------------------------------------------- the heartbeat (rank 0's books)

def attempt(run_dir: Path, first: int, last: int, clock: Clock, exc: BaseException | None = None,
            saves: tuple[int, ...] = (), rank: int = 0) -> Heartbeat:
    """One attempt's beats: steps first..last of 1 s each, a save beat after each step in `saves`."""
    beat = Heartbeat(run_dir, rank, clock=clock, wall=clock, started=clock())
    clock.t += 10  # start-up
    for step in range(first, last + 1):
        beat.beat(step, "step")
        clock.t += 1
        if step in saves:
            beat.beat(step, "checkpoint save")
            clock.t += 0.5
    beat.close(exc)
    return beat


def test_the_heartbeat_counts_a_restart_its_lost_steps_and_only_the_steps_that_count(tmp_path):
    clock = Clock()
    attempt(tmp_path, 1, 12, clock, RuntimeError("Connection reset by peer"), saves=(5, 10))
    books = ledger.load(tmp_path)
    assert books.open and books.restarts == 0 and books.saves == {5: 5.0, 10: 10.0}  # steps 1-12 ran, 1 s each
    assert ledger.read_progress(tmp_path) == (11, 11.0)  # step 12 was under way when the rank failed
    assert json.loads((tmp_path / "faults/rank0.json").read_text())["step"] == 12
    clock.t += 30  # the restart's gap
    attempt(tmp_path, 11, 20, clock, saves=(15, 20))
    books = ledger.load(tmp_path)
    assert books.restarts == 1 and books.lost_steps == 1 and not books.open  # step 11 ran twice
    assert books.useful_s == pytest.approx(20.0)  # steps 1-20 once each
    # wall: 10 s start-up + 12 steps + 2 saves + 30 s gap + 10 s start-up + 10 steps + 2 saves
    assert books.wall_s(clock.t) == pytest.approx(10 + 12 + 1 + 30 + 10 + 10 + 1)
    assert books.goodput(clock.t) == pytest.approx(20 / 74)


def test_a_save_on_a_signal_is_no_restart_and_a_requeue_keeps_the_clock_running(tmp_path):
    from trainer.run.preempt import Interrupted, RequeueRequested

    clock = Clock()
    attempt(tmp_path, 1, 6, clock, RequeueRequested(6), saves=(6,))
    books = ledger.load(tmp_path)
    assert not books.open and books.session_start is not None  # the queue counts: Slurm brings it back
    assert not (tmp_path / "faults").exists()  # a stop is no failure
    attempt(tmp_path, 7, 9, clock, Interrupted(9), saves=(9,))
    books = ledger.load(tmp_path)
    assert books.restarts == 0 and books.lost_steps == 0 and books.session_start is None  # Ctrl-C stops the clock


def test_only_rank_0_keeps_the_books_every_failing_rank_writes_its_record(tmp_path):
    attempt(tmp_path, 1, 3, Clock(), RuntimeError("boom"), rank=1)
    assert not (tmp_path / ledger.LEDGER).exists() and not (tmp_path / ledger.PROGRESS).exists()
    [record] = failure.read(tmp_path)
    assert (record.rank, record.step, record.kind, record.error) == (1, 3, failure.ERROR, "RuntimeError: boom")


# ---------------------------------------------------------------------------- failure records

def test_kinds_of_failure():
    from trainer.run.nonfinite import NonFiniteStop
    from trainer.run.preempt import RequeueRequested
    from trainer.run.shared_dirs import SharedDirError

    class DataError(ValueError):  # matched by name: the real one lives in trainer/data/loader.py
        pass

    assert failure.kind_of(SharedDirError("x")) == failure.kind_of(DataError("y")) == failure.USAGE
    assert failure.kind_of(SystemExit(2)) == failure.USAGE and failure.kind_of(SystemExit(1)) == failure.ERROR
    assert failure.kind_of(NonFiniteStop(3, "nan")) == failure.FATAL
    assert failure.kind_of(RequeueRequested(3)) == failure.STOPPED
    assert failure.kind_of(RuntimeError("x")) == failure.ERROR
    assert failure.describe(SharedDirError("rank 1 on b does not see")) == "rank 1 on b does not see"


def test_the_cause_is_the_first_failure_that_is_not_a_lost_peer(tmp_path):
    fail(tmp_path, 0, 7, "RuntimeError: [pair.cc:537] Read error [10.0.0.2]:4321: Connection reset by peer")
    fail(tmp_path, 1, 7, "RuntimeError: injected fault at step 7 on rank 1")
    records = failure.read(tmp_path)
    assert [r.rank for r in records] == [0, 1] and records[0].peer_lost and not records[1].peer_lost
    assert failure.cause(records).rank == 1
    assert failure.cause(records[:1]).rank == 0  # only a lost peer to go by
    assert failure.cause([]) is None
    (tmp_path / "faults/rank9.json").write_text("{broken")
    assert len(failure.read(tmp_path)) == 2
    failure.clear(tmp_path)
    assert failure.read(tmp_path) == []


def test_a_signature_ignores_ports_and_addresses_but_not_the_step():
    def one(step: int, error: str) -> str:
        return failure.Failure(0, "h", step, "step", failure.ERROR, error, 0.0).signature()

    assert one(7, "Read error [10.0.0.2]:4321: reset") == one(7, "Read error [10.0.0.9]:5555: reset")
    assert one(7, "x at 0x7f3a") == one(7, "x at 0xdead")
    assert one(7, "boom") != one(8, "boom") and one(7, "boom") != one(7, "bang")


# ---------------------------------------------------------------------------- the restart verdict

def test_what_ends_the_run_at_once(tmp_path):
    ckpt = tmp_path / "ckpt"
    fail(tmp_path, 1, 3, "data.path: token id 300 is beyond the vocab (256)", failure.USAGE)
    verdict = restart.judge(tmp_path, ckpt, 1, 3)
    assert not verdict.restart and verdict.exit_code == 2 and verdict.message.startswith("error: data.path: ")
    failure.clear(tmp_path)
    fail(tmp_path, 0, 3, "NonFiniteStop: step 3: non-finite loss", failure.FATAL)
    assert restart.judge(tmp_path, ckpt, 1, 3) == restart.Verdict(False, 1, "")
    failure.clear(tmp_path)
    for state, code in (("interrupted", 130), ("requeue", 75), ("cancelled", 75)):
        RunStatus(tmp_path, True).write(state, 4)
        assert restart.judge(tmp_path, ckpt, 0, 3) == restart.Verdict(False, code, "")
    RunStatus(tmp_path, True).write("completed", 4)
    assert restart.judge(tmp_path, ckpt, 0, 3) == restart.Verdict(False, 0, "")


def test_restarts_in_a_row_are_bounded_and_a_new_checkpoint_starts_the_count_again(tmp_path):
    ckpt = tmp_path / "ckpt"
    commit(ckpt, 5)
    verdicts = []
    for step in (6, 7, 8, 9):  # a different failure each time: no crash loop
        fail(tmp_path, 1, step, f"RuntimeError: bad luck number {'abcd'[step - 6]}")
        verdicts.append(restart.judge(tmp_path, ckpt, 1, 3))
        failure.clear(tmp_path)
    assert [v.restart for v in verdicts] == [True, True, True, False]
    assert "restart 3 of 3 from checkpoint step 5" in verdicts[2].message
    assert "3 restarts in a row without a new checkpoint (launcher.max_restarts 3)" in verdicts[3].message
    commit(ckpt, 10)  # progress since the last restart
    fail(tmp_path, 1, 11, "RuntimeError: bad luck again")
    again = restart.judge(tmp_path, ckpt, 1, 3)
    assert again.restart and "restart 1 of 3 from checkpoint step 10" in again.message
    failure.clear(tmp_path)
    fail(tmp_path, 1, 12, "RuntimeError: bad luck, no restarts")
    assert not restart.judge(tmp_path, ckpt, 1, 0).restart


def test_a_hang_restarts_with_exit_124_and_a_silent_death_restarts_too(tmp_path):
    RunStatus(tmp_path, True).write("hung", 12, "no progress for 10.2 s in step 12")
    verdict = restart.judge(tmp_path, tmp_path / "ckpt", 1, 3)
    assert verdict.restart and verdict.exit_code == 124 and "from step 1 (no checkpoint yet)" in verdict.message
    RunStatus(tmp_path, True).write("running", 12)
    assert restart.judge(tmp_path, tmp_path / "ckpt", 137, 3).restart  # every rank killed: no record at all


def test_the_same_failure_at_the_same_step_twice_is_a_crash_loop(tmp_path):
    for _ in range(2):
        fail(tmp_path, 0, 7, "RuntimeError: Connection reset by peer [10.0.0.2]:4321")
        fail(tmp_path, 1, 7, "RuntimeError: injected fault at step 7 on rank 1")
        verdict = restart.judge(tmp_path, tmp_path / "ckpt", 1, 3)
        failure.clear(tmp_path)
    assert not verdict.restart and verdict.exit_code == 1 and verdict.step == 7
    status = read_status(tmp_path)
    assert status["state"] == "failed" and status["step"] == 7
    assert status["error"] == "crash loop at step 7: RuntimeError: injected fault at step 7 on rank 1"
    restart.forget_last_failure(tmp_path)  # a new `mantra run`: its first failure is not a loop yet
    fail(tmp_path, 1, 7, "RuntimeError: injected fault at step 7 on rank 1")
    assert restart.judge(tmp_path, tmp_path / "ckpt", 1, 3).restart


# ---------------------------------------------------------------------------- status.json, the summary line

def test_status_and_the_summary_line_carry_goodput_restarts_and_lost_steps(tmp_path):
    ledger.save(tmp_path, ledger.Ledger(session_start=time.time() - 6.0, useful_s=3.0, restarts=1, lost_steps=4,
                                        open=True, straggler={"rank": 1, "host": "n2", "ratio": 1.6, "step": 30}))
    RunStatus(tmp_path, True).write("completed", 40)
    status = read_status(tmp_path)
    assert status["restarts"] == 1 and status["lost_steps"] == 4 and 0.45 < status["goodput"] <= 0.5
    assert status["straggler"]["host"] == "n2"
    status["goodput"] = 0.8321
    assert summary_line(status, "tiny") == "mantra: tiny completed at step 40: goodput 83.2%, restarts 1, lost_steps 4"
    assert summary_line({}, "tiny") is None


# ---------------------------------------------------------------------------- stragglers

def test_the_slowest_rank_is_compared_with_its_own_pipeline_stage():
    from trainer.report.straggler import compare

    assert compare([1.0, 1.0, 1.5, 1.0], [0, 0, 0, 0]) == (1.5, 2, 0.5)
    # stage 1 does twice the work: no straggler there; rank 3 is 1.2x its stage's median
    ratio, rank, _ = compare([1.0, 1.0, 2.0, 2.4, 2.0], [0, 0, 1, 1, 1])
    assert rank == 3 and ratio == pytest.approx(1.2)


def test_a_straggler_is_named_once_after_three_slow_log_steps(tmp_path, caplog):
    from trainer.report.straggler import Stragglers

    import torch

    s = Stragglers([], torch.device("cpu"), run_dir=tmp_path)
    s.hosts = ["a", "b", "c"]
    for step, (ratio, rank) in enumerate([(1.5, 1), (1.5, 2), (1.4, 2), (1.1, 2), (1.3, 2), (1.3, 2), (1.6, 2),
                                          (1.6, 2), (1.6, 2)], 1):
        s._judge(10 * step, ratio, rank, 0.05)
    warnings = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("straggler: rank 2 on c took 1.60x") and "(steps 50-70)" in warnings[0]
    assert ledger.load(tmp_path).straggler == {"rank": 2, "host": "c", "ratio": 1.6, "step": 70}
    quiet = Stragglers([], torch.device("cpu"))
    for step in range(5):
        quiet._judge(step, 3.0, 1, 0.002)  # 3x, but 2 ms: a tiny model's jitter
    assert not quiet.warned


# ---------------------------------------------------------------------------- the batch script's questions

def test_the_batch_script_asks_begin_and_after(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    commit(ckpt, 5)
    fail(tmp_path, 1, 7, "RuntimeError: injected fault at step 7 on rank 1")
    assert slurm_restart.main([str(tmp_path), str(ckpt), "3", "after", "1", "0"]) == 0
    assert capsys.readouterr().out == "restart\n" and failure.read(tmp_path) == []  # cleared for the next step
    fail(tmp_path, 1, 7, "RuntimeError: injected fault at step 7 on rank 1")
    slurm_restart.main([str(tmp_path), str(ckpt), "3", "after", "1", "0"])
    out, err = capsys.readouterr()
    assert out == "1\n" and "crash loop at step 7" in err
    # a requeued allocation after the run used up its restarts in a row: begin refuses
    ledger.update(tmp_path, lambda b: (setattr(b, "open", True), setattr(b, "streak", 3),
                                       setattr(b, "committed_at_restart", 5)))
    assert slurm_restart.begin(tmp_path, ckpt, 3, restart_count=1) == 1
    assert slurm_restart.begin(tmp_path, ckpt, 3, restart_count=0) == 0  # a new submission may try again
    assert ledger.load(tmp_path).last_failure is None
    assert slurm_restart.main([str(tmp_path), "begin"]) == 2
