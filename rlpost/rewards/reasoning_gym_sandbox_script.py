"""Runs inside the sandbox: scores reasoning-gym answers whose scorer evaluates them.

The score never comes from a process that evaluated the answer. Three processes:

- the judge (this process) runs each task's ``score_answer`` and prints ``<nonce> <index>
  <score>``; its ``eval`` and ``parse_expr`` are replaced by calls to the evaluator that
  return plain data (a literal, or a sympy expression rebuilt from its ``srepr``);
- the evaluator, forked before any item is read, runs a fresh child per evaluation;
- the child keeps only its reply pipe and loads a seccomp filter refusing signals, ``ptrace``,
  cross-process memory and new processes, so it chooses only its evaluation's value.

A timeout or a child dying without a reply leaves the item ``nan``. The judge and evaluator are not
dumpable; /tmp is off ``sys.path``. stdin: one JSON line (``paths``, ``timeout_s``, ``filter``),
then JSON with ``nonce`` and ``items`` (a base64 pickle of plain data)."""

import ast
import base64
import builtins
import ctypes
import json
import os
import pickle
import select
import signal
import struct
import sys
import time

_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 4, 38, 22, 2
_MAX_REPLY = 1 << 20
_HEAD_FORMAT, _REPLY_FORMAT = ">IId", ">II"  # (size, id, deadline_s), (size, id)
_HEAD, _REPLY_HEAD = struct.calcsize(_HEAD_FORMAT), struct.calcsize(_REPLY_FORMAT)
_SYMPY_CALLS = frozenset(
    "Add Mul Pow Integer Rational Float Symbol Tuple Equality Unequality StrictLessThan "
    "LessThan StrictGreaterThan GreaterThan sin cos tan cot sec csc asin acos atan acot "
    "sinh cosh tanh exp log Abs sign floor ceiling factorial".split()
)
_SYMPY_NAMES = frozenset({"pi", "E", "I", "oo", "zoo", "nan", "true", "false"})
_EXACT = frozenset({"Integer", "Rational", "Float", "Symbol"})  # built as they are
_LIBC = ctypes.CDLL(None, use_errno=True)


class Unscored(BaseException):
    """The item gets no score; a BaseException, so no scorer's ``except Exception`` eats it."""


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _prctl(*args):
    if _LIBC.prctl(*args) != 0:
        raise OSError(ctypes.get_errno(), f"prctl{args[:1]} failed")


def _fill(fd, view, deadline=None):
    """Read ``fd`` into ``view`` (no copy); the bytes read, fewer at EOF or past ``deadline``."""
    got = 0
    while got < len(view):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
            break
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return got


def _write(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _child(request, w, program):
    """Evaluate one request, confined, and write the reply on ``w``; never returns."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, w)
        os.closerange(w + 1, 1 << 16)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        buf = ctypes.create_string_buffer(program, len(program))
        fprog = _Fprog(len(program) // 8, ctypes.addressof(buf))
        _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
    except BaseException:
        os._exit(3)  # unconfined: evaluate nothing
    try:
        request = json.loads(request)
        if request["op"] == "eval":
            reply = {"ok": repr(eval(request["text"], {}))}  # confined by the filter above
        else:
            import sympy
            from sympy.parsing.sympy_parser import parse_expr

            names = {k: rebuild(v) for k, v in request["locals"].items()}
            value = parse_expr(request["text"], local_dict=names, evaluate=request["evaluate"])
            reply = {"ok": sympy.srepr(value)}
    except Exception as exc:
        reply = {"error": type(exc).__name__}
    try:
        _write(w, json.dumps(reply).encode()[: _MAX_REPLY + 1])
    finally:
        os._exit(0)


def _serve(requests, replies, program):
    """The evaluator's loop: one confined child per request; two buffers zeroed once used, so
    a later child finds no earlier text."""
    request = memoryview(bytearray(_HEAD + _MAX_REPLY))
    reply = memoryview(bytearray(_MAX_REPLY + 1))
    while _fill(requests, request[:_HEAD]) == _HEAD:
        size, ident, deadline_s = struct.unpack_from(_HEAD_FORMAT, request)
        if size > _MAX_REPLY or _fill(requests, request[_HEAD : _HEAD + size]) != size:
            break
        deadline = time.monotonic() + max(deadline_s, 0.0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(bytes(request[_HEAD : _HEAD + size]), w, program)
        os.close(w)
        request[_HEAD : _HEAD + size] = bytes(size)
        got = _fill(r, reply, deadline)
        os.close(r)
        os.kill(pid, signal.SIGKILL)  # it cannot fork, so it is the only one to end
        os.waitpid(pid, 0)
        got = got if got <= _MAX_REPLY else 0  # too long, or cut at the deadline: not JSON
        _write(replies, struct.pack(_REPLY_FORMAT, got, ident))
        _write(replies, reply[:got])
        reply[:got] = bytes(got)
    os._exit(0)


def start_evaluator(program):
    """Fork the evaluator; (request fd, reply fd) of the judge's side."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    if os.fork() == 0:
        try:
            os.close(req_w)
            os.close(rep_r)
            os.close(0)
            try:  # it and its children are the first the OOM killer takes, not the judge
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")
            except OSError:
                pass
            _prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
            _serve(req_r, rep_w, program)
        finally:
            os._exit(1)
    os.close(req_r)
    os.close(rep_w)
    return req_w, rep_r


def rebuild(text):
    """The sympy expression of ``srepr`` text, built from :data:`_SYMPY_CALLS` alone."""
    import sympy

    def build(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = build(node.operand)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return -value
        if isinstance(node, ast.Tuple):
            return tuple(build(e) for e in node.elts)
        if isinstance(node, ast.Name) and node.id in _SYMPY_NAMES:
            return getattr(sympy, node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in _SYMPY_CALLS:
                kwargs = {k.arg: build(k.value) for k in node.keywords if k.arg}
                if node.func.id not in _EXACT:
                    kwargs["evaluate"] = False
                return getattr(sympy, node.func.id)(*map(build, node.args), **kwargs)
        raise ValueError(f"not an expression: {ast.dump(node)[:80]}")

    return build(ast.parse(text, mode="eval").body)


class Evaluator:
    """The judge's handle on the evaluator: ``eval`` and ``parse_expr`` that return data."""

    def __init__(self, fds, deadline):
        self.requests, self.replies = fds
        self.deadline = deadline  # of the item in progress (monotonic seconds)
        self.ids = 0
        self.broken = False

    def _ask(self, request):
        if self.broken:
            raise Unscored("the evaluator is gone")
        self.ids += 1
        data = json.dumps(request).encode()
        if len(data) > _MAX_REPLY:
            raise ValueError("text too long to evaluate")
        left = self.deadline() - time.monotonic()
        head = struct.pack(_HEAD_FORMAT, len(data), self.ids, left)
        # The alarm waits until the reply is read whole, so the channel stays in frame.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            _write(self.requests, head + data)
            top = memoryview(bytearray(_REPLY_HEAD))
            size, ident = (0, 0)
            if _fill(self.replies, top) == _REPLY_HEAD:
                size, ident = struct.unpack(_REPLY_FORMAT, top)
            body = memoryview(bytearray(size))
            complete = ident == self.ids and _fill(self.replies, body) == size
        except OSError:
            complete = False
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if not complete:
            self.broken = True
            raise Unscored("the evaluator is gone")
        try:
            got = json.loads(bytes(body)) if size else {}
        except ValueError:
            got = {}
        if isinstance(got, dict) and isinstance(got.get("ok"), str):
            return got["ok"]
        if isinstance(got, dict) and isinstance(got.get("error"), str):
            raise ValueError(f"the evaluation raised {got['error']}")
        raise Unscored("the evaluation gave no reply in time")

    def eval(self, source, globals=None, locals=None):
        if not isinstance(source, str):
            raise TypeError("eval() of anything but text is not served here")
        return ast.literal_eval(self._ask({"op": "eval", "text": source}))

    def parse_expr(self, s, local_dict=None, transformations=None, global_dict=None, evaluate=True):
        if transformations is not None or global_dict is not None:
            raise ValueError("parse_expr with transformations or global_dict is not served here")
        import sympy

        names = {str(k): sympy.srepr(v) for k, v in (local_dict or {}).items()}
        request = {"op": "parse_expr", "text": str(s), "locals": names, "evaluate": evaluate}
        return rebuild(self._ask(request))


def route_evaluation(evaluator):
    """Send every ``eval`` and ``parse_expr`` of this process to ``evaluator``."""
    from sympy.parsing import sympy_parser

    original = sympy_parser.parse_expr
    builtins.eval = evaluator.eval
    for module in list(sys.modules.values()):
        if getattr(module, "parse_expr", None) is original:
            module.parse_expr = evaluator.parse_expr


def _read_line(fd):
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line


def _on_alarm(signum, frame):
    raise Unscored("the item overran its time")


def main():
    head = json.loads(_read_line(0))
    sys.path[:] = head["paths"]
    import reasoning_gym
    from sympy.parsing import sympy_parser  # noqa: F401 (imported once, before the fork)

    timeout_s = head["timeout_s"]
    item_deadline = [0.0]
    fds = start_evaluator(base64.b64decode(head["filter"]))
    _prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    spec = json.loads(sys.stdin.buffer.read())
    items = pickle.loads(base64.b64decode(spec["items"]))
    datasets = {}
    for task, config, _, _ in items:
        key = (task, json.dumps(config, sort_keys=True, default=str))
        if key not in datasets:
            datasets[key] = reasoning_gym.create_dataset(task, seed=0, size=1, **config)
    evaluator = Evaluator(fds, lambda: item_deadline[0])
    route_evaluation(evaluator)
    signal.signal(signal.SIGALRM, _on_alarm)
    nonce = spec["nonce"]
    for i, (task, config, entry, answer) in enumerate(items):
        if evaluator.broken:
            break  # the trusted side runs the rest again in a new sandbox
        dataset = datasets[(task, json.dumps(config, sort_keys=True, default=str))]
        print(f"{nonce} {i} start", flush=True)
        item_deadline[0] = time.monotonic() + timeout_s
        value = "nan"
        try:  # an alarm between the score and disarming it is caught all the same
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s + 0.5)
                value = repr(float(dataset.score_answer(answer, entry)))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except (Unscored, Exception):
            pass
        print(f"{nonce} {i} {value}", flush=True)


if __name__ == "__main__":
    main()
