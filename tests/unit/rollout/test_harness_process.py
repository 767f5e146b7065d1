"""A harness command's environment is an allow-list; its output is kept as a bounded tail."""

from __future__ import annotations

import io

from rlpost.rollout.harness_process import Tail, harness_env


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
