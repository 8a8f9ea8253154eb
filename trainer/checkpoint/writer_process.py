"""The background write's byte work, done by a process of its own at the lowest CPU priority.

    training process (one background thread per save)          writer process (nice 19, one per rank)
    -------------------------------------------------          -------------------------------------
    Staging(shared=True) lays the buffers out in a memfd  -->  maps the arena (its fd sent once per layout)
    finite(entries): which staged tensor holds NaN/inf    -->  one sum per tensor over the arena
    write_shard(path, tensors): DCP's chunks for this rank -->  reads them from the arena, writes the shard
                                                               (trainer/checkpoint/shard_file.py), hashes it
    DCP planning, metadata.json, the commit, collectives       nothing else: no torch.distributed, no commit

Why a process: on the 2-core machines mantra is tested on, a thread doing the same work took its CPU from
training's threads and the steps it overlapped ran 1.4-1.8x slower; lowering a thread's priority made it
worse (it was preempted while holding the GIL). A process at nice 19 runs on what training leaves idle and
holds no lock training needs; its write takes longer, the steps it overlaps do not (bench/checkpoint.py).

Protocol: length-prefixed JSON requests and replies over a Unix socket pair, a request's payload (bytes of
tensors outside the arena) after its header, the arena's fd passed with SCM_RIGHTS. One request at a time.
The writer exits when the socket closes (the rank ended or died; a write in progress is finished
first, into a step directory nothing will commit). If it dies, the request in flight raises WriterDied;
the caller restarts it and writes the step again (trainer/checkpoint/background.py): nothing is committed
until every rank's shard is written and hashed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import torch

from trainer.checkpoint.finite import first_nonfinite
from trainer.checkpoint.shard_file import write_shard

log = logging.getLogger(__name__)

HEADER = struct.Struct("!II")  # JSON length, payload length
MAX_JSON = 64 << 20
NICE = 19
# tests only (tests/test_checkpoint_writer_process.py): the writer waits before each shard while this file exists
PAUSE_FILE_ENV = "MANTRA_TEST_CKPT_WRITER_PAUSE_FILE"


class WriterDied(RuntimeError):
    """The writer process ended while a request was in flight (killed, or out of memory)."""


def _send(sock: socket.socket, message: dict, payload: bytes | memoryview = b"", fds: tuple[int, ...] = ()) -> None:
    header = json.dumps(message).encode()
    frame = HEADER.pack(len(header), len(payload)) + header
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)
    if len(payload):
        sock.sendall(payload)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, have = [], 0
    while have < n:
        chunk = sock.recv(min(n - have, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[dict, bytes, list[int]] | None:
    """One message (header, payload, received fds), or None at the end of the stream."""
    head, fds, _, _ = socket.recv_fds(sock, HEADER.size, 4)
    if not head:
        return None
    rest = _recv_exactly(sock, HEADER.size - len(head)) if len(head) < HEADER.size else b""
    if rest is None:
        return None
    json_len, payload_len = HEADER.unpack(head + rest)
    if json_len > MAX_JSON:
        raise ValueError(f"checkpoint writer: a message of {json_len} bytes")
    body = _recv_exactly(sock, json_len + payload_len)
    if body is None:
        return None
    return json.loads(body[:json_len]), body[json_len:], fds


class WriterProcess:
    """The training side: starts the writer, shares the staging arena with it, sends it work."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self._arena = None  # the SharedArena the writer maps (sent again after a restart)
        self._shared = None  # the arena the running writer has

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "trainer.checkpoint.writer_process", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self.sock, self._shared = ours, None
        log.info("checkpoint writer process started (pid %d, nice %d)", self.proc.pid, NICE)

    def restart(self) -> None:
        """A new writer in place of this one (which is ended first), mapping the same arena."""
        self.close()
        self.start()
        if self._arena is not None:
            self.share(self._arena)

    def close(self) -> None:
        """End the writer: closing the socket asks it to exit; it is killed if it has not within 10 s."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def share(self, arena) -> None:
        """Make `arena` (trainer/checkpoint/staging.py's SharedArena) the one the writer reads from."""
        self._arena = arena
        if self.proc is None:
            self.start()
        if self._shared is not arena:
            self._request({"op": "arena", "size": arena.size}, fds=(arena.fd,))
            self._shared = arena

    def finite(self, named: dict[str, torch.Tensor]) -> str | None:
        """The first of the floating tensors `named` (all in the shared arena) holding NaN or inf, else None."""
        entries = []
        for name, tensor in named.items():
            offset = self._arena.locate(tensor)
            if offset is None:
                raise ValueError(f"checkpoint writer: {name} is not in the staging arena")
            entries.append([name, offset, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")])
        return self._request({"op": "finite", "entries": entries})["bad"]

    def write_shard(self, path: os.PathLike, tensors: list[torch.Tensor], algorithm: str) -> tuple[int, str]:
        """Write `tensors`' bytes, in order, as the file `path`; its (size, checksum). A tensor in the arena
        is read there by the writer; any other travels in the request."""
        pieces, payload = [], []
        for tensor in tensors:
            offset = self._arena.locate(tensor) if self._arena is not None else None
            nbytes = tensor.numel() * tensor.element_size()
            if offset is None:
                payload.append(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            pieces.append([offset, nbytes])
        reply = self._request({"op": "write", "path": os.fspath(path), "pieces": pieces, "algorithm": algorithm},
                              b"".join(payload))
        return reply["size"], reply["checksum"]

    def _request(self, message: dict, payload: bytes = b"", fds: tuple[int, ...] = ()) -> dict:
        if self.proc is None:
            self.start()
        try:
            _send(self.sock, message, payload, fds)
            got = _recv(self.sock)
        except (BrokenPipeError, ConnectionResetError):
            got = None
        if got is None:
            raise WriterDied(self._death())
        reply = got[0]
        if "errno" in reply:
            raise OSError(reply["errno"], reply["error"])
        if "error" in reply:
            raise RuntimeError(f"checkpoint writer: {reply['error']}")
        return reply

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = "did not exit" if code is None else \
            f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"the checkpoint writer process (pid {self.proc.pid}) died mid-request ({how})"


# -- the writer process ------------------------------------------------------------------------------------

def _finite(arena, entries: list) -> str | None:
    named = {}
    for name, offset, shape, dtype_name in entries:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"not a floating dtype: {dtype_name!r}")
        named[name] = arena[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
    return first_nonfinite(named)


def _write(arena, message: dict, payload: bytes) -> dict:
    pause = os.environ.get(PAUSE_FILE_ENV)
    while pause and os.path.exists(pause):
        time.sleep(0.01)
    tensors, inline, at = [], memoryview(bytearray(payload)), 0
    for offset, nbytes in message["pieces"]:
        if offset is None:
            tensors.append(torch.frombuffer(inline[at:at + nbytes], dtype=torch.uint8) if nbytes else torch.empty(0))
            at += nbytes
        else:
            tensors.append(arena[offset:offset + nbytes])
    size, checksum = write_shard(message["path"], tensors, message["algorithm"])
    return {"size": size, "checksum": checksum}


def serve(sock: socket.socket) -> None:
    """Answer requests until the socket closes."""
    import mmap

    arena = None
    while (got := _recv(sock)) is not None:
        message, payload, fds = got
        try:
            if message["op"] == "arena":
                shared = mmap.mmap(fds[0], message["size"])
                os.close(fds[0])
                arena = torch.frombuffer(shared, dtype=torch.uint8)
                reply = {}
            elif message["op"] == "finite":
                reply = {"bad": _finite(arena, message["entries"])}
            elif message["op"] == "write":
                reply = _write(arena, message, payload)
            else:
                reply = {"error": f"unknown request {message['op']!r}"}
        except OSError as exc:
            reply = {"error": str(exc), **({"errno": exc.errno} if exc.errno is not None else {})}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _send(sock, reply)


def main() -> None:
    os.nice(NICE)
    torch.set_num_threads(1)
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
