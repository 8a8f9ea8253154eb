"""checkpoint.async_writer: process (trainer/checkpoint/writer_process.py), and the shard file every save
writes (trainer/checkpoint/shard_file.py): the bytes on disk are exactly the tensors' whether the
filesystem takes O_DIRECT or not; the writer process writes what the thread writes, runs at nice 19, and a
writer SIGKILLed mid-write is restarted and the step written again, or, killed twice, fails the save
with nothing committed."""

from __future__ import annotations

import errno
import logging
import os
import signal
import time

import pytest
import torch
import yaml

from conftest import tiny_config

STEP1, STEP2 = "step-00000001", "step-00000002"


@pytest.fixture
def local(tmp_path):
    from checkpoint_attack import build_local

    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(tiny_config("local", tmp_path / "local", steps=4)))
    return build_local(path)


def _pieces() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(3, 1000, generator=gen), torch.empty(0), torch.randn(1, generator=gen).to(torch.bfloat16),
            torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=gen), torch.randn(5000, generator=gen).double(),
            torch.arange(7, dtype=torch.int64)]


def _expected(tensors) -> bytes:
    return b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("direct", [True, False])
def test_a_shard_file_holds_exactly_the_bytes_written(tmp_path, direct):
    """Many flushes of a small bounce buffer, pieces of every size around the 4 KiB alignment (an empty
    one, a 2-byte one), the last block cut back to the exact size."""
    from trainer.checkpoint.integrity import ALGORITHM, checksum_bytes, new_hasher
    from trainer.checkpoint.shard_file import ALIGN, ShardFile

    tensors, hasher = _pieces(), new_hasher(ALGORITHM)
    with ShardFile(tmp_path / "shard", hasher, direct=direct, block=2 * ALIGN) as f:
        offsets = [f.write(t) for t in tensors]
    expected = _expected(tensors)
    assert (tmp_path / "shard").read_bytes() == expected and f.size == len(expected)
    assert hasher.hexdigest() == checksum_bytes(expected, ALGORITHM)
    sizes = [t.numel() * t.element_size() for t in tensors]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]


def test_a_filesystem_that_refuses_direct_writes_gets_the_same_bytes(tmp_path, monkeypatch):
    """O_DIRECT accepted at open but the first write refused (EINVAL, as some filesystems do): the file is
    written through the page cache from its first byte."""
    from trainer.checkpoint import shard_file
    from trainer.checkpoint.integrity import ALGORITHM, new_hasher

    real, refused = os.write, []

    def write(fd, data):
        if os.O_DIRECT & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL):
            refused.append(len(data))
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data)

    monkeypatch.setattr(shard_file.os, "write", write)
    tensors = _pieces()
    with shard_file.ShardFile(tmp_path / "shard", new_hasher(ALGORITHM), block=2 * shard_file.ALIGN) as f:
        for t in tensors:
            f.write(t)
    assert refused and not f.direct
    assert (tmp_path / "shard").read_bytes() == _expected(tensors)


def _checkpointer(root, writer: str):
    from trainer.checkpoint.checkpointer import Checkpointer

    return Checkpointer(root, keep=3, rank=0, world_size=1, device=torch.device("cpu"), writer=writer)


def test_the_writer_process_writes_what_the_thread_and_a_synchronous_save_write(local, tmp_path):
    model, sync, schedule, loader = local
    process, thread, synchronous = (_checkpointer(tmp_path / n, w) for n, w in
                                    (("p", "process"), ("t", "thread"), ("s", "thread")))
    process.save(1, sync, model, schedule, loader, asynchronous=True)
    thread.save(1, sync, model, schedule, loader, asynchronous=True)
    synchronous.save(1, sync, model, schedule, loader)
    pid = process.writer.pid
    assert pid != os.getpid() and os.getpriority(os.PRIO_PROCESS, pid) == 19
    assert process.staging.arena is not None and process.staging.arena.locate(next(iter(process.staging.buffers.values()))) == 0
    process.wait()
    thread.wait()
    shards = [(tmp_path / n / STEP1 / "__0_0.distcp").read_bytes() for n in "pts"]
    assert shards[0] == shards[1] == shards[2] and len(shards[0]) > 100_000
    arena = process.staging.arena
    process.save(2, sync, model, schedule, loader, asynchronous=True)
    assert process.staging.arena is arena and process.writer.pid == pid  # both reused
    process.close()
    assert process.writer.proc is None and _gone(pid)
    assert (tmp_path / "p/latest").read_text().strip() == STEP2


def test_a_writer_process_that_cannot_start_leaves_the_rank_writing_from_a_thread(local, tmp_path, monkeypatch,
                                                                                   caplog):
    from trainer.checkpoint.writer_process import WriterProcess

    def refused(self):
        raise OSError(11, "Resource temporarily unavailable")  # what fork says at a process limit

    monkeypatch.setattr(WriterProcess, "start", refused)
    model, sync, schedule, loader = local
    ckpt = _checkpointer(tmp_path / "ckpt", "process")
    with caplog.at_level(logging.WARNING):
        ckpt.save(1, sync, model, schedule, loader, asynchronous=True)
    assert "checkpoint writer process unusable" in caplog.text and ckpt.writer is None
    ckpt.close()
    assert (tmp_path / "ckpt/latest").read_text().strip() == STEP1 and (tmp_path / "ckpt" / STEP1 / "COMMITTED").exists()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _kill_writer_mid_write(ckpt, step_dir) -> int:
    """SIGKILL the writer once the step's small files are down (the check is done, the shard is next)."""
    _wait_for(lambda: (step_dir / "rng-rank0.safetensors").exists(), "the save never reached its shard")
    pid = ckpt.writer.pid
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: ckpt.writer.pid not in (None, pid), "the writer was not restarted")
    return pid


def test_a_writer_killed_mid_write_is_restarted_and_the_step_written_again(local, tmp_path, monkeypatch, caplog):
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.writer_process import PAUSE_FILE_ENV

    model, sync, schedule, loader = local
    pause = tmp_path / "pause"
    pause.touch()  # the writer waits before each shard while it exists
    monkeypatch.setenv(PAUSE_FILE_ENV, str(pause))
    ckpt = _checkpointer(tmp_path / "ckpt", "process")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        ckpt.save(1, sync, model, schedule, loader, asynchronous=True)
        _kill_writer_mid_write(ckpt, tmp_path / "ckpt" / STEP1)
        pause.unlink()
        ckpt.close()
    assert "writing the step again with a new writer process" in caplog.text
    assert "killed by SIGKILL" in caplog.text
    assert (tmp_path / "ckpt/latest").read_text().strip() == STEP1
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fresh = Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"))
    assert fresh.load_latest(None, sync, model, schedule, loader).step == 1  # every checksum verified
    assert all(torch.equal(expected[k], v) for k, v in model.state_dict().items())


def test_a_writer_killed_twice_fails_the_save_and_commits_nothing(local, tmp_path, monkeypatch):
    from trainer.checkpoint.writer_process import PAUSE_FILE_ENV, WriterDied

    model, sync, schedule, loader = local
    pause = tmp_path / "pause"
    monkeypatch.setenv(PAUSE_FILE_ENV, str(pause))
    ckpt = _checkpointer(tmp_path / "ckpt", "process")
    ckpt.save(1, sync, model, schedule, loader, asynchronous=True)
    ckpt.wait()
    pause.touch()
    ckpt.save(2, sync, model, schedule, loader, asynchronous=True)
    first = _kill_writer_mid_write(ckpt, tmp_path / "ckpt" / STEP2)
    second = ckpt.writer.pid
    _wait_for(lambda: not ckpt.writing or second != first, "no second writer")
    os.kill(second, signal.SIGKILL)
    with pytest.raises(WriterDied, match=r"checkpoint step 2 not committed: the checkpoint writer process \(pid \d+\) "
                                         r"died mid-request \(killed by SIGKILL\), also when written again"):
        ckpt.wait()
    assert (tmp_path / "ckpt/latest").read_text().strip() == STEP1
    assert not (tmp_path / "ckpt" / STEP2 / "COMMITTED").exists()
    pause.unlink()
    ckpt.close()


def _writers_of(pid: int) -> list[int]:
    """The checkpoint writer processes whose parent is `pid`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = open(f"/proc/{entry.name}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{entry.name}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"trainer.checkpoint.writer_process" in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.distributed
def test_a_ranks_writer_killed_mid_write_is_restarted_on_that_rank_and_every_rank_writes_again(tmp_path, monkeypatch):
    """dp2 zero2, async saves at steps 2 and 4: rank 1's writer is SIGKILLed while step 2's shard is due.
    DCP tells both ranks; both write the step again (rank 1 with a new writer) and the run completes. A run
    resumed from that step 2 repeats steps 3-4 exactly: what was committed is the state of step 2."""
    from test_checkpoint import last_per_step, mantra_run, rank_pids, start, write
    from trainer.checkpoint.writer_process import PAUSE_FILE_ENV

    pause = tmp_path / "pause"
    pause.touch()
    monkeypatch.setenv(PAUSE_FILE_ENV, str(pause))
    settings = {"checkpoint": {"every": 2, "keep": 3, "async_save": True}, "train": {"steps": 4},
                "parallel": {"optimizer_sharding": "zero2"}}
    path = write(tmp_path, "kw", settings)
    proc = start(path, 2)
    try:
        step2 = tmp_path / "kw/ckpt" / STEP2
        _wait_for(lambda: (step2 / "rng-rank1.safetensors").exists() or proc.poll() is not None, "no step 2 save", 240)
        ranks = rank_pids(tmp_path / "kw/manifest.yaml")
        assert len(ranks) == 2, ranks
        rank1 = max(ranks, key=lambda p: open(f"/proc/{p}/environ", "rb").read().count(b"RANK=1\0"))
        (killed,) = _writers_of(rank1)
        os.kill(killed, signal.SIGKILL)  # rank 0's writer is paused before its shard: the kill lands mid-save
        pause.unlink()
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "writing the step again with a new writer process" in err and "killed by SIGKILL" in err
    assert (tmp_path / "kw/ckpt/latest").read_text().strip() == "step-00000004"
    assert (step2 / "COMMITTED").exists()
    monkeypatch.delenv(PAUSE_FILE_ENV)
    again = mantra_run(write(tmp_path, "kw2", {**settings, "checkpoint": {**settings["checkpoint"],
                                                                          "resume_from": str(step2)}}), 2)
    assert again.returncode == 0, again.stderr[-3000:]
    first, second = last_per_step(tmp_path / "kw"), last_per_step(tmp_path / "kw2")
    assert sorted(second) == [3, 4] and [second[s] for s in (3, 4)] == [first[s] for s in (3, 4)]
