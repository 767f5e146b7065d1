"""A seccomp filter refusing the system calls whose memory or CPU no per-process limit bounds.

Used where no per-run cgroup is available (``cgroup.py``): RLIMIT_AS counts only address
spaces, while memfds, SysV segments, message queues, socket buffers, grown pipes, io_uring
rings, AIO contexts and pipes holding spliced pages keep kernel memory past it, and
``sched_setaffinity`` would leave the pinned CPU. Those calls fail with EPERM (``fcntl`` only
for ``F_SETPIPE_SZ``, ``socket`` for any family but ``AF_UNIX``); the keyring calls are
refused on every path.

Hand-written classic BPF, not libseccomp, whose Python bindings come only with the system
interpreter; bubblewrap loads it (``--seccomp FD``). As the kernel's ``samples/seccomp``, a
call from another ABI (i386, x32, arm32 compat) kills the process.
"""

from __future__ import annotations

import platform
import struct
from typing import NamedTuple

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR_OFFSET = 0
_ARCH_OFFSET = 4
_ARGS_OFFSET = 16  # both ABIs are little-endian: an argument's low 32 bits come first
# Classic BPF opcodes (linux/bpf_common.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
# linux/seccomp.h return actions.
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
EPERM = 1
# x32 system calls are x86_64 calls with this bit set; the filter refuses them all.
_X32_SYSCALL_BIT = 0x40000000

# What the filter refuses, by purpose; ``plan`` picks the groups a cgroup does not cover.
SHARED_MEMORY_CALLS = (
    "memfd_create",
    "memfd_secret",
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semctl",
    "semtimedop",
)
# Kernel memory no address space counts, which a cgroup v1 or v2 memory group charges.
KERNEL_MEMORY_CALLS = (
    "socket",
    "socketpair",
    "fcntl(F_SETPIPE_SZ)",
    "mq_open",
    "vmsplice",
    "splice",
    "tee",
    "sendfile",
    "io_setup",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
    "bpf",
    "perf_event_open",
    "userfaultfd",
)
# What a cgroup v1 memory group does not charge: TCP and UDP buffers (unix ones it does).
NETWORK_SOCKET_CALLS = ("socket(not AF_UNIX)",)
AFFINITY_CALLS = ("sched_setaffinity",)
KEYRING_CALLS = ("add_key", "keyctl", "request_key")
# A call refused only for one argument value: (call, argument index, refuse when equal?, value).
ARGUMENT_RULES = {
    "fcntl(F_SETPIPE_SZ)": ("fcntl", 1, True, 1031),
    "socket(not AF_UNIX)": ("socket", 0, False, 1),
}
# Calls some ABIs never had (aarch64 has only inotify_init1); skipped where absent.
_LEGACY_CALLS = frozenset({"inotify_init"})


class _Arch(NamedTuple):
    audit: int
    numbers: dict[str, int]
    x32_bit: bool


# Numbers from arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.
ARCHES = {
    "x86_64": _Arch(
        0xC000003E,  # AUDIT_ARCH_X86_64
        {
            "shmget": 29,
            "shmat": 30,
            "shmctl": 31,
            "semget": 64,
            "semop": 65,
            "semctl": 66,
            "shmdt": 67,
            "msgget": 68,
            "msgsnd": 69,
            "msgrcv": 70,
            "msgctl": 71,
            "sched_setaffinity": 203,
            "io_setup": 206,
            "semtimedop": 220,
            "memfd_create": 319,
            "memfd_secret": 447,
            "sendfile": 40,
            "socket": 41,
            "socketpair": 53,
            "fcntl": 72,
            "mq_open": 240,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "inotify_init": 253,
            "inotify_init1": 294,
            "perf_event_open": 298,
            "fanotify_init": 300,
            "bpf": 321,
            "userfaultfd": 323,
            "splice": 275,
            "tee": 276,
            "vmsplice": 278,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
        },
        x32_bit=True,
    ),
    "aarch64": _Arch(
        0xC00000B7,  # AUDIT_ARCH_AARCH64
        {
            "io_setup": 0,
            "sendfile": 71,
            "vmsplice": 75,
            "splice": 76,
            "tee": 77,
            "sched_setaffinity": 122,
            "msgget": 186,
            "msgctl": 187,
            "msgrcv": 188,
            "msgsnd": 189,
            "semget": 190,
            "semctl": 191,
            "semtimedop": 192,
            "semop": 193,
            "shmget": 194,
            "shmctl": 195,
            "shmat": 196,
            "shmdt": 197,
            "memfd_create": 279,
            "memfd_secret": 447,
            "fcntl": 25,
            "inotify_init1": 26,
            "mq_open": 180,
            "socket": 198,
            "socketpair": 199,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "perf_event_open": 241,
            "fanotify_init": 262,
            "bpf": 280,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
        },
        x32_bit=False,
    ),
}


def supported(machine: str | None = None) -> bool:
    """Whether a filter can be built for this machine (``platform.machine()``) and loaded
    by this kernel (one built with seccomp shows a ``Seccomp:`` line in /proc/self/status)."""
    if (machine or platform.machine()) not in ARCHES:
        return False
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            return any(line.startswith("Seccomp:") for line in f)
    except OSError:
        return False


def build_filter(
    blocked: tuple[str, ...] | list[str],
    machine: str | None = None,
    numbers: dict[str, dict[str, int]] | None = None,
) -> bytes:
    """The ``struct sock_filter`` array refusing ``blocked`` with EPERM, allowing the rest.

    ``numbers`` adds to the tables (machine, then name); ``ValueError`` for an unknown one."""
    machine = machine or platform.machine()
    arch = ARCHES.get(machine)
    if arch is None:
        raise ValueError(f"no seccomp syscall table for {machine}; known: {', '.join(ARCHES)}")
    arch = arch._replace(numbers={**arch.numbers, **(numbers or {}).get(machine, {})})
    whole = {name for name in blocked if name not in ARGUMENT_RULES}
    whole -= {name for name in _LEGACY_CALLS if name not in arch.numbers}
    rules: dict[str, list[tuple[int, bool, int]]] = {}
    for name in sorted(set(blocked) & ARGUMENT_RULES.keys()):
        call, arg, equal, value = ARGUMENT_RULES[name]
        if call not in whole:
            rules.setdefault(call, []).append((arg, equal, value))
    unknown = [name for name in [*whole, *rules] if name not in arch.numbers]
    if unknown:
        raise ValueError(f"no syscall number for {', '.join(unknown)} on {machine}")
    program = [
        (_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        (_JEQ_K, 1, 0, arch.audit),  # the expected ABI skips the kill
        (_RET_K, 0, 0, RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _NR_OFFSET),
    ]
    if arch.x32_bit:
        program += [(_JGE_K, 0, 1, _X32_SYSCALL_BIT), (_RET_K, 0, 0, RET_KILL_PROCESS)]
    for name in sorted(whole, key=arch.numbers.__getitem__):
        program += [(_JEQ_K, 0, 1, arch.numbers[name]), (_RET_K, 0, 0, RET_ERRNO | EPERM)]
    for call in sorted(rules, key=arch.numbers.__getitem__):
        program += _argument_block(arch.numbers[call], rules[call])
    program.append((_RET_K, 0, 0, RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def _argument_block(number: int, rules: list[tuple[int, bool, int]]) -> list[tuple]:
    """For call ``number``: refuse when any rule matches the low 32 bits of its argument,
    else allow; any other call jumps over the block with the syscall number still loaded."""
    body: list[tuple] = []
    refuse_at = 2 * len(rules) + 1  # index of the refusal in ``body``
    for k, (arg, equal, value) in enumerate(rules):
        to_refuse = refuse_at - (2 * k + 1) - 1
        jt, jf = (to_refuse, 0) if equal else (0, to_refuse)
        body += [(_LD_W_ABS, 0, 0, _ARGS_OFFSET + 8 * arg), (_JEQ_K, jt, jf, value)]
    body += [(_RET_K, 0, 0, RET_ALLOW), (_RET_K, 0, 0, RET_ERRNO | EPERM)]
    return [(_JEQ_K, 0, len(body), number), *body]
