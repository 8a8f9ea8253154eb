"""The loader's background reader, a thread or worker processes (data.workers): what it reads equals a
synchronous read, and a failure in it is never a hang. A data source that raises on rank 1's k-th sample
under `mantra run --nproc 2` ends the job within 10 s, with the reader's traceback, the source and the
sample; so does a worker process killed with SIGKILL, with the step, samples and source it was reading."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, tiny_config
from trainer.data import loader as data_module
from trainer.data import prefetch as P
from trainer.data.loader import build_loader
from trainer.manifest.schema import DataSection


def test_prefetched_steps_equal_synchronous_reads_and_a_jump_restarts(tmp_path):
    path = tmp_path / "x.bin"
    (np.arange(64 * 8 + 1) % 256).astype(np.uint16).tofile(path)

    def loader(prefetch):
        return build_loader(DataSection(source="tokens", path=str(path), prefetch=prefetch), seq_len=8, vocab=256,
                            seed=1, global_batch=4, micro_batch=2, microbatches=2, prefetch=prefetch)

    sync, ahead = loader(0), loader(3)
    for step in [0, 1, 2, 3, 9, 10, 2, 3]:  # 9 and the second 2: a jump starts the reader over from there
        got, want = ahead.microbatches(step), sync.microbatches(step)
        assert all(torch.equal(a, b) for pa, pb in zip(got, want) for a, b in zip(pa, pb))
    assert ahead.order.step == 4
    thread = ahead._ahead._thread
    assert thread.is_alive() and thread.daemon
    ahead.close()
    assert not thread.is_alive()


def _tokens(tmp_path):
    path = tmp_path / "x.bin"
    (np.arange(64 * 8 + 1) % 256).astype(np.uint16).tofile(path)
    return str(path)


def _loader(path, prefetch, workers):
    return build_loader(DataSection(source="tokens", path=path, prefetch=prefetch, workers=workers), seq_len=8,
                        vocab=256, seed=1, global_batch=4, micro_batch=2, microbatches=2)


def test_worker_processes_read_what_a_synchronous_read_gives(tmp_path):
    path = _tokens(tmp_path)
    sync, ahead = _loader(path, 0, 0), _loader(path, 3, 2)
    for step in [0, 1, 2, 3, 9, 10, 2, 3]:  # 9 and the second 2: a jump starts the workers over from there
        got, want = ahead.microbatches(step), sync.microbatches(step)
        assert all(torch.equal(a, b) for pa, pb in zip(got, want) for a, b in zip(pa, pb))
    workers = list(ahead._ahead._pool._processes.values())
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    ahead.close()
    assert not any(w.is_alive() for w in workers)


def _fail_in_workers(monkeypatch, how, at_window=5):
    """TokenStream.window raises (or the process kills itself) at window `at_window`, in forked workers only."""
    parent, real = os.getpid(), data_module.TokenStream.window

    def window(self, index, seq_len):
        if os.getpid() != parent and index == at_window:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(f"injected read error at window {index}")
        return real(self, index, seq_len)

    monkeypatch.setattr(data_module.TokenStream, "window", window)  # forked workers inherit it


def _step_reading(loader, window):
    return next(s for s in range(64) if window in loader.order.samples(s)[1])


def test_a_worker_that_raises_or_dies_fails_the_step_that_needed_it(tmp_path, monkeypatch):
    path = _tokens(tmp_path)
    _fail_in_workers(monkeypatch, "raise")
    ahead = _loader(path, 2, 2)
    bad = _step_reading(ahead, 5)
    with pytest.raises(data_module.DataReadError, match=r"reading sample \d+ \(step \d+, window 5\) of data source") as err:
        for step in range(bad + 1):
            ahead.microbatches(step)
    assert step == bad  # the steps before it came through
    remote = str(err.value.__cause__)  # the worker's own traceback, as text
    assert "OSError: injected read error at window 5" in remote and "in _worker_read" in remote
    ahead.close()

    _fail_in_workers(monkeypatch, "kill")
    ahead = _loader(path, 2, 2)
    start = time.perf_counter()
    with pytest.raises(P.PrefetchError, match=rf"a data worker process died while reading step {bad} \(samples "
                       rf"{bad * 4}\.\.{bad * 4 + 3} of data source '.*x.bin'\)"):
        for step in range(bad + 1):
            ahead.microbatches(step)
    assert time.perf_counter() - start < 5
    ahead.close()


def test_an_exception_in_the_reader_is_raised_by_the_step_that_needed_it():
    def make(step):
        if step == 3:
            raise KeyError(f"no sample for step {step}")
        return step * 10

    ahead = P.Prefetcher(make, depth=2)
    assert [ahead.get(s) for s in range(3)] == [0, 10, 20]
    with pytest.raises(KeyError, match="no sample for step 3") as err:
        ahead.get(3)
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "make" in frames and "_work" in frames  # the reader's own frames come along
    assert ahead.get(5) == 50  # a later call starts a new reader
    ahead.close()


def test_a_reader_gone_without_an_answer_is_noticed_not_waited_for(monkeypatch):
    monkeypatch.setattr(P, "POLL_S", 0.05)
    ahead = P.Prefetcher(lambda step: step, depth=1)
    monkeypatch.setattr(ahead, "_work", lambda first, out, stop: None)  # ends at once, hands over nothing
    start = time.perf_counter()
    with pytest.raises(P.PrefetchError, match="ended without step 0's batches"):
        ahead.get(0)
    assert time.perf_counter() - start < 2


def test_close_stops_a_reader_blocked_on_a_full_queue():
    ahead = P.Prefetcher(lambda step: step, depth=1)
    assert ahead.get(0) == 0
    thread = ahead._thread
    while ahead._queue.qsize() < 1:  # the reader has read step 1 and now waits to put step 2
        thread.join(0.01)
    ahead.close()
    assert not thread.is_alive()


FAULT = '''\
import os
if os.environ.get("RANK") == "1":  # torchrun's worker of rank 1 only
    import time
    import trainer.data.loader as data
    real, calls = data.TokenStream.window, {"n": 0}
    def window(self, index, seq_len):
        calls["n"] += 1
        if calls["n"] == int(os.environ["FAIL_SAMPLE"]):
            with open(os.environ["FAIL_STAMP"], "w") as f:
                f.write(repr(time.time()))
            if os.environ["FAIL_HOW"] == "kill":  # a data worker process killed in the middle of a read
                import signal
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(f"injected read error at window {index}")
        return real(self, index, seq_len)
    data.TokenStream.window = window
'''


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("workers, how", [(0, "raise"), (2, "raise"), (2, "kill")])
def test_a_failing_data_source_ends_the_job_within_seconds(tmp_path, workers, how):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAULT)  # every rank imports it at start-up
    config = tiny_config("datafault", tmp_path / "run", steps=100000)
    config["launcher"] = {"nproc": 2, "max_restarts": 0}  # the failure itself, not the restart after it
    config["data"]["workers"] = workers  # 0: the reader thread; 2: worker processes, forked from rank 1
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    stamp = tmp_path / "failed-at"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]), FAIL_SAMPLE="200",
               FAIL_STAMP=str(stamp), FAIL_HOW=how, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "run", str(path), "--nproc", "2"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    ended = time.time()
    assert stamp.exists(), proc.stderr[-3000:]
    delay = ended - float(stamp.read_text())
    assert delay < 10, f"the job outlived its failed data source by {delay:.1f} s"
    print(f"job ended {delay:.2f} s after the data source failed ({'thread' if not workers else 'workers'}, {how})")
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    if how == "raise":
        assert "OSError: injected read error at window" in err
        assert "trainer.data.loader.DataReadError: reading sample " in err and "of data source '" in err
        assert "python-docs.txt' failed" in err  # the source, by the name the manifest gives it
        if workers:  # the worker process's traceback, carried over as text
            assert "_RemoteTraceback" in err and "in _worker_read" in err
        else:  # the reader thread's traceback
            assert "trainer/data/prefetch.py" in err and "in _work" in err
    else:
        assert "trainer.data.prefetch.PrefetchError: a data worker process died while reading step " in err
        assert "python-docs.txt')" in err and "(samples " in err  # the samples and the source it was reading
    assert "resource_tracker" not in err and "leaked" not in err  # no shared memory left behind
    rows = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert rows  # it trained until the failure
