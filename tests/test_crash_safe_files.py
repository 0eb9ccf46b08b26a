"""Crash-safe files (runtime/atomic_file.py): a writer killed at any moment, or one that runs out of
disk, never costs the previous file.

The kill test forks the test process (the model and two sessions are already in memory, so a trial
costs a fork and a few milliseconds of saving, not a model load), lets the child save a session in
a loop, SIGKILLs it after a random delay spread over four of a child's saves (the median of five
children's first saves, whose spread on a busy machine is wide; counted from the moment the child
starts saving: kills land inside the first save, after its rename, and inside later saves), and
loads the file: it is
always one of the two sessions, complete and verified by its checksum.
"""
from __future__ import annotations

import os
import random
import resource
import signal
import struct
import subprocess
import time

import pytest

import ringllm
from ringllm.runtime.atomic_file import atomic_open, stale_temporaries, write_bytes
from ringllm.session import ChatSession, SessionFileError

TRIALS = 200


# ---------------------------------------------------------------------------------------------
# The helper on its own
# ---------------------------------------------------------------------------------------------

def test_replace_and_keep_on_error(tmp_path):
    path = tmp_path / "f.bin"
    write_bytes(path, b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(path, "wb") as fh:
            fh.write(b"half of the new")
            raise RuntimeError("writer fails mid-way")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]          # the failed writer's temporary is gone
    write_bytes(path, "new")
    assert path.read_bytes() == b"new"


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    path = tmp_path / "f.bin"
    dead = subprocess.Popen(["true"])
    dead.wait()                                       # a pid that no longer runs
    stale = tmp_path / f".f.bin.{dead.pid}-00000000.tmp"
    live = tmp_path / f".f.bin.{os.getpid()}-11111111.tmp"   # a writer still running (us)
    other = tmp_path / ".g.bin.1-22222222.tmp"                # another file's temporary
    for p in (stale, live, other):
        p.write_bytes(b"partial")
    assert stale_temporaries(path) == [str(stale)]
    write_bytes(path, b"x")
    assert sorted(os.listdir(tmp_path)) == sorted(["f.bin", live.name, other.name])


# ---------------------------------------------------------------------------------------------
# Sessions: SIGKILL at random points, disk full
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sessions(smollm2_path):
    """Two different saved-able sessions (A: one turn, B: two turns) of one small-capacity LLM."""
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False,
                      kv=ringllm.KVConfig(capacity=48, policy="streaming"))
    a = llm.chat_session(system="Be terse.", seed=1)
    a.send("Hi", stream=False, max_tokens=3)
    b = llm.chat_session(system="Be terse.", seed=2)
    b.send("Name a colour.", stream=False, max_tokens=3)
    b.send("Another one.", stream=False, max_tokens=3)
    return llm, {"A": a, "B": b}


def _which(llm, path, sessions) -> str:
    """Load `path` (must succeed) and say which session it holds."""
    loaded = ChatSession.load(llm, path)
    for name, s in sessions.items():
        if loaded.messages == s.messages and loaded.tokens == s.tokens:
            return name
    raise AssertionError("the file holds neither session")


def _save_forever(session, path, ready_fd: int) -> None:
    """Child of os.fork(): say it is about to save (a byte on ready_fd), then save in a loop until
    killed; never returns into pytest."""
    try:
        os.write(ready_fd, b"s")
        while True:
            session.save(path)
    finally:
        os._exit(3)


def _first_save_seconds_in_a_child(session, path) -> float:
    """How long a forked child's first save takes: what the kills' delays are spread over. A child's
    first save is not the parent's (its first writes copy the pages it shares with the parent, and
    its fsyncs meet whatever else the machine writes), so it is timed where the kills happen."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            t0 = time.perf_counter()
            session.save(path)
            os.write(w, struct.pack("<d", time.perf_counter() - t0))
        finally:
            os._exit(0)
    os.close(w)
    took = struct.unpack("<d", os.read(r, 8))[0]
    os.close(r)
    os.waitpid(pid, 0)
    return took


def test_sigkill_while_saving_keeps_a_whole_session(sessions, tmp_path):
    llm, by_name = sessions
    path = str(tmp_path / "chat.session")
    by_name["A"].save(path)
    save_s = sorted(_first_save_seconds_in_a_child(by_name["A"], path) for _ in range(5))[2]
    rng = random.Random(34)
    current, mid_write, switched = "A", 0, 0
    for _ in range(TRIALS):
        new = "B" if current == "A" else "A"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _save_forever(by_name[new], path, w)
        os.close(w)
        assert os.read(r, 1) == b"s"          # the clock starts when the child starts saving, not at fork
        os.close(r)
        time.sleep(rng.uniform(0.0, 4.0 * save_s))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        left = stale_temporaries(path)
        assert len(left) <= 1, left                   # each save removed the earlier writers' leftovers
        mid_write += bool(left)
        got = _which(llm, path, by_name)
        assert got in (current, new)
        switched += got != current
        current = got
    # the kills landed both inside writes (a temporary left behind) and after a rename
    print(f"{TRIALS} SIGKILLs: {mid_write} left a temporary (killed inside a write), {switched} found the new "
          f"session (killed after a rename); "
          f"save {save_s * 1e3:.0f} ms")
    assert mid_write >= TRIALS // 10 and switched >= TRIALS // 10, (mid_write, switched)
    by_name[current].save(path)
    assert os.listdir(tmp_path) == ["chat.session"]


def _save_in_child(session, path, limit_bytes: int | None) -> tuple[int, str]:
    """Save `session` in a forked child (under RLIMIT_FSIZE when limit_bytes is set); returns the
    child's exit code (0 saved, 1 SessionFileError, 2 another exception) and the error text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code, text = 2, ""
        try:
            os.close(r)
            if limit_bytes is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # the write fails with EFBIG instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
            session.save(path)
            code = 0
        except SessionFileError as exc:
            code, text = 1, str(exc)
        except BaseException as exc:      # reported to the parent, which fails the test
            text = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(w, text.encode()[:4000])
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        text = fh.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


def test_file_size_limit_gives_a_clear_error_and_keeps_the_old_file(sessions, tmp_path):
    llm, by_name = sessions
    path = str(tmp_path / "chat.session")
    by_name["A"].save(path)
    before = open(path, "rb").read()
    code, text = _save_in_child(by_name["B"], path, limit_bytes=64 * 1024)
    assert code == 1, text
    assert "cannot be written" in text and "File too large" in text and "unchanged" in text
    assert open(path, "rb").read() == before
    assert _which(llm, path, by_name) == "A"
    assert os.listdir(tmp_path) == ["chat.session"]


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(n_bytes) -> a folder on a tmpfs of that size (needs root and mount rights;
    skipped elsewhere); unmounted after the test."""
    mounted = []

    def mount(n_bytes: int):
        mnt = tmp_path / "tmpfs"
        mnt.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={n_bytes}", "tmpfs", str(mnt)],
                                               capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_gives_a_clear_error_and_keeps_the_old_file(sessions, tmp_path, mount_tmpfs):
    llm, by_name = sessions
    sizes = {}
    for name, s in by_name.items():
        s.save(tmp_path / name)
        sizes[name] = os.path.getsize(tmp_path / name)
    page = 4096
    # room for A and half of B: B's temporary runs out of space half-way
    folder = mount_tmpfs(-(-(sizes["A"] + sizes["B"] // 2) // page) * page)
    path = str(folder / "chat.session")
    by_name["A"].save(path)
    before = open(path, "rb").read()
    with pytest.raises(SessionFileError, match="No space left on device.*unchanged"):
        by_name["B"].save(path)
    assert open(path, "rb").read() == before
    assert _which(llm, path, by_name) == "A"
    assert os.listdir(folder) == ["chat.session"]
