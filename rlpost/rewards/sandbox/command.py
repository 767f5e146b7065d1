"""The command line that runs one program inside the sandbox.

Layers, outermost first::

    sh      (only with a per-run cgroup: writes its pid into the run's groups, then execs)
    taskset one CPU (outside bwrap: inside, seccomp may refuse sched_setaffinity)
    unshare (a private mount namespace, in a user namespace of its own when not
             root, where sh mounts the run's /tmp and /dev/shm as tmpfs capped in
             bytes and in files; as root it also stages a private interpreter
             prefix on a world-readable path)
    setpriv (only when started as root: become uid/gid 65534, no groups, no new privileges)
    bwrap   user, pid, network, ipc, uts and cgroup namespaces; read-only /usr and
            interpreter; capped private tmpfs on /tmp and /dev/shm, the only
            writable places (bwrap's own root is remounted read-only); fresh /proc,
            minimal /dev; cleared environment; dies with its parent; a seccomp
            filter where the run has no memory or cpuset cgroup (``plan.py``)
    prlimit RLIMIT_AS, RLIMIT_CPU, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE, no core
            dumps, no locked memory, no POSIX message queues, few queued signals
    python  -E -s -S main.py   (standard library only, no site-packages)

Why uid 65534 before bwrap: bwrap started by root maps the sandbox user to host root, which
RLIMIT_NPROC never binds. Why prlimit inside: the process cap set after bwrap's user namespace
exists is each run's own, so one fork bomb cannot starve concurrent runs. Why the outer mount
namespace: bwrap's ``--tmpfs`` has no file count, and tmpfs inodes hold kernel memory their
size does not count, so the two tmpfs are mounted here with ``nr_inodes``; it also stages an
interpreter under /root (mode 0700) onto a path uid 65534 reaches, seen at ``/opt/python``.

The run as a whole is bounded by its cgroup (``cgroup.py``) where the host gives one, else by
the seccomp filter (``seccomp.py``); without a memory cgroup a run can still hold up to
``max_processes`` address spaces of ``memory_mb`` each.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass

from rlpost.rewards.sandbox.limits import SandboxConfig

SANDBOX_UID = 65534
SANDBOX_PYTHON = "/opt/python"
# Paths inside the outer mount namespace only (a fresh tmpfs over /tmp there).
_STAGE = "/tmp"
_STAGING = f"{_STAGE}/rlpost-python"
_SCRATCH = {"/tmp": f"{_STAGE}/tmp", "/dev/shm": f"{_STAGE}/shm"}
_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib64", "lib32", "libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
# Both arrived in bubblewrap 0.8.0; without them the sandbox would be weaker, so refuse.
_REQUIRED_OPTIONS = ("--disable-userns", "--size")
_INSTALL_BWRAP = "install it with: apt-get install -y bubblewrap"
_INSTALL_UTIL_LINUX = "install it with: apt-get install -y util-linux"
_SIGPENDING = 256


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here; the message names the cause and the fix."""


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the host programs the command line uses."""

    bwrap: str
    prlimit: str
    taskset: str
    setpriv: str | None
    # the cgroup join and the mount stage need a shell
    sh: str | None = None
    # The mount stage (util-linux).
    unshare: str | None = None
    mount: str | None = None


@dataclass(frozen=True)
class Interpreter:
    """Where the sandbox's Python lives: ``host_prefix`` mounted at ``SANDBOX_PYTHON`` (None:
    under /usr), ``executable`` its path inside."""

    host_prefix: str | None
    executable: str


def find_tools() -> Tools:
    """Locate bwrap and the util-linux helpers, or raise ``SandboxUnavailable``."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"bubblewrap (bwrap) is not on PATH; {_INSTALL_BWRAP}")
    found: dict[str, str] = {}
    as_root = ["setpriv", "unshare", "mount", "sh"] if os.geteuid() == 0 else []
    for name in ["prlimit", "taskset", "setpriv", "unshare", "mount", "sh"]:
        path = shutil.which(name)
        if path is not None:
            found[name] = path
        elif name in ["prlimit", "taskset", *as_root]:
            raise SandboxUnavailable(f"{name} (util-linux) is not on PATH; {_INSTALL_UTIL_LINUX}")
    options = bwrap_options(bwrap)
    missing = [option for option in _REQUIRED_OPTIONS if option not in options]
    if missing:
        raise SandboxUnavailable(
            f"{bwrap} lacks {', '.join(missing)}; bubblewrap >= 0.8.0 is needed, {_INSTALL_BWRAP}"
        )
    return Tools(
        bwrap=bwrap,
        prlimit=found["prlimit"],
        taskset=found["taskset"],
        setpriv=found.get("setpriv"),
        sh=found.get("sh"),
        unshare=found.get("unshare"),
        mount=found.get("mount"),
    )


@functools.cache
def bwrap_options(bwrap: str) -> frozenset[str]:
    """The long options this bwrap accepts, read from its ``--help``."""
    proc = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", proc.stdout + proc.stderr))


@functools.cache
def find_interpreter() -> Interpreter:
    """Resolve the base interpreter of ``sys.executable`` (a venv resolves to its base)."""
    prefix = os.path.realpath(sys.base_prefix)
    executable = os.path.realpath(sys.executable)
    if not executable.startswith(prefix + os.sep):
        major, minor = sys.version_info[:2]
        executable = os.path.realpath(os.path.join(prefix, "bin", f"python{major}.{minor}"))
    if not (executable.startswith(prefix + os.sep) and os.access(executable, os.X_OK)):
        raise SandboxUnavailable(
            f"cannot find the interpreter of {sys.executable} under its base prefix {prefix}"
        )
    if prefix == "/usr" or prefix.startswith("/usr/"):
        return Interpreter(host_prefix=None, executable=executable)
    relative = os.path.relpath(executable, prefix)
    return Interpreter(host_prefix=prefix, executable=f"{SANDBOX_PYTHON}/{relative}")


def build_command(
    tools: Tools,
    interpreter: Interpreter,
    config: SandboxConfig,
    *,
    cpu: int,
    files: list[tuple[int, str]],
    info_fd: int,
    argv: list[str],
    join: list[str] | None = None,
    seccomp_fd: int | None = None,
) -> list[str]:
    """The full argv: cgroup join, CPU pin, privilege drop, bwrap, prlimit, then ``python <argv>``;
    ``files``: ``(fd, name)`` copied into ``/tmp/name``; ``info_fd``: bwrap's JSON."""
    prefix_source = interpreter.host_prefix
    outer: list[str] = [*(join or []), tools.taskset, "--cpu-list", str(cpu)]
    root = os.geteuid() == 0
    staged = caps_files(tools)
    if staged:
        private = root and prefix_source is not None and not _readable_by_others(prefix_source)
        outer += _mount_stage(tools, config, prefix_source if private else None, user=not root)
        prefix_source = _STAGING if private else prefix_source
    if root:
        uid = str(SANDBOX_UID)
        outer += [str(tools.setpriv), "--reuid", uid, "--regid", uid, "--clear-groups"]
        outer += ["--no-new-privs", "--"]
    inner = _namespaces(tools) + _filesystem(config, prefix_source, files, staged)
    inner += ["--info-fd", str(info_fd), "--clearenv"]
    if seccomp_fd is not None:
        inner += ["--seccomp", str(seccomp_fd)]
    inner += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    inner += ["--setenv", "LANG", "C.UTF-8"]
    if interpreter.host_prefix is not None:
        # A relocated prefix: its RUNPATH points at the host path of libpython.
        inner += ["--setenv", "LD_LIBRARY_PATH", f"{SANDBOX_PYTHON}/lib"]
    return outer + inner + ["--", *_limits(tools, config), interpreter.executable, *argv]


def caps_files(tools: Tools) -> bool:
    """Whether runs get tmpfs capped in files: as root, or in a user namespace of their own."""
    return os.geteuid() == 0 or _user_mounts(tools.unshare, tools.sh)


@functools.cache
def _user_mounts(unshare: str | None, sh: str | None) -> bool:
    """Whether this user may mount a tmpfs inside an unprivileged user namespace."""
    if unshare is None or sh is None:
        return False
    probe = [unshare, "--user", "--map-root-user", "--mount", "--", sh, "-c", "exit 0"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):  # no namespace to be had: size caps only
        return False


def _mount_stage(
    tools: Tools, config: SandboxConfig, private_prefix: str | None, *, user: bool
) -> list[str]:
    """unshare + sh: the run's tmpfs capped in bytes and files, and a staged prefix (without
    root in a user namespace of its own)."""
    mount = shlex.quote(str(tools.mount))
    capped = f"nosuid,nodev,mode=1777,size={config.tmpfs_mb << 20},nr_inodes={config.max_tmp_files}"
    script = ["set -e", f"{mount} -t tmpfs -o nosuid,nodev,mode=0755,size=1m rlpost {_STAGE}"]
    for path in _SCRATCH.values():
        script.append(f"{mount} -t tmpfs -o {capped},X-mount.mkdir rlpost-scratch {path}")
    if private_prefix is not None:
        where = f"{shlex.quote(private_prefix)} {_STAGING}"
        script.append(f"{mount} --bind -o ro,X-mount.mkdir {where}")
    script.append('exec "$@"')
    own = ["--user", "--map-root-user"] if user else []
    stage = [str(tools.unshare), *own, "--mount", "--propagation", "private", "--"]
    return [*stage, str(tools.sh), "-c", "\n".join(script), "rlpost-mounts"]


def _namespaces(tools: Tools) -> list[str]:
    args = [tools.bwrap, "--unshare-all", "--unshare-user", "--hostname", "sandbox"]
    args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL"]
    # --disable-userns: no nested user namespace, so no capabilities to regain inside.
    args += ["--die-with-parent", "--new-session", "--disable-userns"]
    return args


def _filesystem(
    config: SandboxConfig, prefix_source: str | None, files: list[tuple[int, str]], staged: bool
) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    if prefix_source is not None:
        args += ["--ro-bind", prefix_source, SANDBOX_PYTHON]
    size = str(config.tmpfs_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    # RLIMIT_FSIZE bounds one file, the size all of them, nr_inodes their number
    for inside in ("/dev/shm", "/tmp"):
        args += (
            ["--bind", _SCRATCH[inside], inside] if staged else ["--size", size, "--tmpfs", inside]
        )
    for fd, name in files:
        args += ["--file", str(fd), f"/tmp/{name}"]
    # bwrap's root is a tmpfs without a size cap; nothing may be written there.
    args += ["--remount-ro", "/", "--chdir", "/tmp"]
    return args


def _limits(tools: Tools, config: SandboxConfig) -> list[str]:
    cpu_s = config.cpu_seconds
    return [
        tools.prlimit,
        f"--as={config.memory_mb << 20}",
        f"--cpu={cpu_s}:{cpu_s + 1}",
        f"--nproc={config.max_processes}",
        f"--fsize={config.max_file_mb << 20}",
        f"--nofile={config.max_open_files}",
        "--core=0",
        # kernel memory no program run here needs
        "--memlock=0",
        "--msgqueue=0",
        f"--sigpending={_SIGPENDING}",
        "--",
    ]


def _readable_by_others(path: str) -> bool:
    """Whether a user outside the owner and group can traverse every ancestor of ``path``."""
    current = path
    while True:
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(current)
        if parent == current:
            return True
        current = parent
