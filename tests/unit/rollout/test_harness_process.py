"""A harness command's environment is an allow-list, under a uid of its own when the trainer is
root, with a /tmp and /dev/shm of its own; its output is kept as a bounded tail."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from rlpost.rollout.episodes.harness_process import (
    REAPER,
    HarnessProcess,
    Tail,
    harness_env,
    private_scratch,
)


def test_the_environment_is_the_basics_the_listed_names_and_the_session():
    trainer = {
        "PATH": "/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C", "TMPDIR": "/tmp",
        "RLPOST_ADMIN_KEY": "a", "RLPOST_API_KEY": "b", "HF_TOKEN": "c", "WANDB_API_KEY": "d",
        "AWS_SECRET_ACCESS_KEY": "e", "OPENAI_API_KEY": "the trainer's", "HTTPS_PROXY": "p",
    }  # fmt: skip
    env = harness_env("http://127.0.0.1:1/sessions/s/v1", "session-key", ("HTTPS_PROXY",), trainer)
    assert env == {
        "PATH": "/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C", "TMPDIR": "/tmp",
        "HTTPS_PROXY": "p", "OPENAI_BASE_URL": "http://127.0.0.1:1/sessions/s/v1",
        "OPENAI_API_KEY": "session-key",
    }  # fmt: skip


def test_a_tail_keeps_the_last_bytes_and_counts_the_rest():
    tail = Tail(limit=10)
    data = b"".join(b"line %d\n" % i for i in range(10000)) + b"answer\n"
    tail.read(io.BytesIO(data))
    assert tail.text() == "99\nanswer\n" and tail.dropped == len(data) - 10
    assert len(tail.buf) == 10


# Each command writes its pid, waits for its sibling's, tries to read the sibling's
# environment, then waits until the sibling has tried too before it exits.
PATH = {"PATH": "/usr/bin:/bin"}
PEEK = r"""
echo $$ > "$D/pid.$ME"
until [ -s "$D/pid.$OTHER" ]; do sleep 0.05; done
cat "/proc/$(cat "$D/pid.$OTHER")/environ" 2>&1 | tr '\0' '\n'
echo "read-exit $?"
touch "$D/done.$ME"
until [ -e "$D/done.$OTHER" ]; do sleep 0.05; done
"""


def _peek_at_each_other(own_user: bool) -> list[str]:
    # Not under pytest's tmp_path: its parents are root's alone, closed to a harness uid;
    # nor under /tmp, which each command has of its own.
    shared = Path(tempfile.mkdtemp(prefix="rlpost-peek-", dir="/var/tmp"))
    shared.chmod(0o1777)  # both commands write here, whatever their uid
    procs, runs = [], [None, None]
    try:
        for me, other in (("a", "b"), ("b", "a")):
            env = harness_env("http://127.0.0.1:1/v1", f"key-of-{me}", environ=PATH)
            env.update(D=str(shared), ME=me, OTHER=other)
            procs.append(HarnessProcess(("/bin/sh", "-c", PEEK), env, own_user=own_user))
        threads = [
            threading.Thread(target=lambda i=i: runs.__setitem__(i, procs[i].run("")))
            for i in (0, 1)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(shared)
    assert all(r is not None and r.returncode == 0 for r in runs), runs
    return [r.stdout for r in runs]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can run a command under another uid")
def test_a_harness_cannot_read_a_siblings_key_from_proc():
    a_saw, b_saw = _peek_at_each_other(own_user=True)
    assert "key-of-b" not in a_saw and "key-of-a" not in b_saw
    assert "Permission denied" in a_saw and "Permission denied" in b_saw
    # Run as the trainer's user, the same commands do read each other's keys.
    a_saw, b_saw = _peek_at_each_other(own_user=False)
    assert "OPENAI_API_KEY=key-of-b" in a_saw and "OPENAI_API_KEY=key-of-a" in b_saw


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can run a command under another uid")
def test_a_harness_runs_under_a_uid_of_its_own_with_a_private_home():
    code = 'id -u; id -G; echo "$HOME"; echo "$TMPDIR"; stat -c %u:%a "$HOME"; touch "$HOME/x"'
    env = harness_env("http://127.0.0.1:1/v1", "k", environ=PATH)
    first = HarnessProcess(("/bin/sh", "-c", code), env)
    second = HarnessProcess(("/bin/sh", "-c", code), env)  # both held at once
    outs = [first.run(""), second.run("")]
    assert [o.returncode for o in outs] == [0, 0], outs
    lines = [o.stdout.split() for o in outs]
    uids = [int(line[0]) for line in lines]
    assert uids[0] != uids[1] and all(50000 <= u < 60000 for u in uids)
    assert [line[1] for line in lines] == [str(u) for u in uids]  # its own group, no other
    for line, uid in zip(lines, uids, strict=True):
        assert line[2] == line[3] and line[4] == f"{uid}:700"
        assert not os.path.exists(line[2])  # removed when the command ended


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can run a command under another uid")
def test_a_command_its_uid_cannot_run_is_one_line_naming_the_fix():
    # Outside /tmp, which the command has of its own; mkdtemp's mode is 0700.
    private = Path(tempfile.mkdtemp(prefix="rlpost-private-", dir="/var/tmp"))
    script = private / "agent.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    env = harness_env("http://127.0.0.1:1/v1", "k", environ=PATH)
    try:
        done = HarnessProcess((str(script),), env).run("")
    finally:
        shutil.rmtree(private)
    assert done.returncode == 127
    assert "Permission denied" in done.stderr and "agent.harness.user=trainer" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def _leave_and_look() -> tuple[str, str, str]:
    """One command that writes a file in /tmp and in /dev/shm, one that looks for them."""
    name = f"rlpost-scratch-{uuid.uuid4().hex}"
    leave = f'echo LEFT > /tmp/{name} && echo LEFT > /dev/shm/{name} && echo "$TMPDIR"'
    look = f"cat /tmp/{name} /dev/shm/{name} 2>&1; ls -A /tmp /dev/shm; id -u"
    return name, leave, look


@pytest.mark.parametrize("own_user", [True, False])
def test_a_command_cannot_read_what_an_earlier_one_left_in_tmp(own_user):
    if os.geteuid() != 0 and not private_scratch():
        pytest.skip("not root, and this kernel refuses unprivileged user namespaces")
    name, leave, look = _leave_and_look()
    env = harness_env("http://127.0.0.1:1/v1", "k", environ={**PATH, "TMPDIR": "/tmp/gone"})
    first = HarnessProcess(("/bin/sh", "-c", leave), env, own_user=own_user).run("")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("/tmp")  # TMPDIR inside what it sees, never the trainer's
    second = HarnessProcess(("/bin/sh", "-c", look), env, own_user=own_user).run("")
    assert second.returncode == 0 and "LEFT" not in second.stdout, second.stdout
    assert second.stdout.count("No such file") == 2
    # Nothing reached the host's /tmp or /dev/shm either.
    assert not any(Path(d, name).exists() for d in ("/tmp", "/dev/shm"))


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
    reason="running the reaper as uid 65534 needs root, setpriv and a /usr/bin/python3",
)
def test_a_reaper_that_is_not_root_makes_the_private_tmp_in_a_user_namespace():
    name, leave, look = _leave_and_look()
    drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
    reaper = ["/usr/bin/python3", "-I", "-S", str(REAPER), str(os.getpid()), "-", "private"]

    def run(code: str) -> subprocess.CompletedProcess:
        argv = [*drop, *reaper, "/bin/sh", "-c", code]
        env = {**PATH, "HOME": "/nonexistent"}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    first = run(leave)
    if first.returncode == 127 and "private /tmp" in first.stderr:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {first.stderr.strip()}")
    assert first.returncode == 0, first.stderr
    second = run(look)
    assert second.returncode == 0 and "LEFT" not in second.stdout, second.stdout
    assert second.stdout.count("No such file") == 2
    assert second.stdout.split()[-1] == "65534"  # it kept its user
    assert not any(Path(d, name).exists() for d in ("/tmp", "/dev/shm"))
