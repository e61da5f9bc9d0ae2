"""Fresh processes for the tests' short subprocesses, without paying ``import torch`` in each.

Why: a test run starts ~200 processes (CLI runs, ``python -c`` scripts, servers, ranks), and
~130 of them live under 6 s, ~2 s of which is the interpreter importing torch (measured 11-30:
1.9-2.7 s on the 2-core machines). This module keeps one *zygote* per test process that has
imported torch and nothing else (no kiln: ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` while it imports),
and forks it for each run, as Python's own ``multiprocessing`` forkserver does with its preloaded
modules. The child is a real process: its own pid, exit status, stdin/stdout/stderr (files the
caller reads afterwards), environment, working directory and ``sys.argv``; it then does what the
end of ``import torch`` would have done with *its* environment (the device-backend autoload,
which is what imports kiln's device), and runs the script, ``-m`` module or console script as the
interpreter would (``__main__``, ``sys.path[0]``), exiting through the interpreter's shutdown
steps (non-daemon threads joined, ``atexit``, flushed streams).

The one difference a child can see: torch (and, through its autoload, kiln's device) is
imported before its code runs, as it is once that code imports torch, kiln or the tests'
modules. So what the zygote cannot honour falls back to :func:`subprocess.run`, and nothing is
tested on a different footing: ``-c`` code that names none of torch, kiln and tests; an
environment that differs from the zygote's in anything read while torch is imported
(``OMP_*``, ``TORCH_*``, ``PYTHONPATH`` entries holding a ``sitecustomize``, ``LD_*``, ...),
interpreter flags, or any other command line. Tests of what ``import torch`` itself does use
a new interpreter (``run_py(new_interpreter=True)``). ``KILN_TEST_FORKSERVER=0`` turns the
zygote off for a whole run.
"""
import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# variables read while ``import torch`` runs (by torch, OpenMP, MKL, oneDNN, the loader or the
# interpreter): a child whose value differs runs as a plain subprocess
IMPORT_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "TORCH_", "PYTORCH_",
               "LD_", "PYTHON", "CUDA", "NVIDIA_", "ATEN_", "MALLOC_", "TORCHINDUCTOR_")

_ZYGOTE = r'''
import json, os, select, signal, socket, sys, time
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
import torch  # noqa: F401  (the reason this process exists)
del os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"]
path, parent = sys.argv[1], os.getppid()
zygote_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(16)
print("ready", flush=True)
children = {}


def child(req, fds):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))     # PR_SET_PDEATHSIG: dies with the zygote
    if os.getppid() == 1:
        os._exit(137)
    os.setpgid(0, 0)
    listener.close()
    for c in children.values():
        c.close()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    # PYTHONPATH's entries follow sys.path[0], as the interpreter puts them
    ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:] = ours + [p for p in sys.path[1:] if p not in zygote_pythonpath]
    code = 0
    try:
        if torch._is_device_backend_autoload_enabled():
            torch._import_device_backends()
        import runpy, types
        kind, arg, argv = req["kind"], req["arg"], req["argv"]
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        if kind == "c":
            sys.argv = ["-c"] + argv
            sys.path[0] = ""
            exec(compile(arg, "<string>", "exec"), main.__dict__)
        elif kind == "m":
            sys.argv = ["-m"] + argv
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(arg, alter_argv=True)      # what `python -m` calls
        else:
            sys.argv = [arg] + argv
            sys.path[0] = os.path.dirname(arg)
            main.__file__ = arg
            with open(arg, "rb") as f:
                exec(compile(f.read(), arg, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<zygote>":
            tb = tb.tb_next                      # the zygote's own frames: not the script's
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    try:
        import threading
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


while True:
    if os.getppid() != parent:           # the test process is gone
        break
    ready, _, _ = select.select([listener], [], [], 0.05)
    if ready:
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not msg.endswith(b"\n"):
            msg += conn.recv(1 << 20)
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            child(req, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        children[pid] = conn
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()
'''


class _Zygote:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kiln-zygote-")
        self.path = os.path.join(self.dir, "s")
        self.env = dict(os.environ)
        code = f"exec(compile({_ZYGOTE!r}, '<zygote>', 'exec'))"
        self.proc = subprocess.Popen([sys.executable, "-c", code, self.path], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, env=self.env)
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the test zygote did not start")
        atexit.register(self.close)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)

    def serves(self, env) -> bool:
        if self.proc.poll() is not None:
            return False
        keys = {k for k in set(env) | set(self.env) if k.startswith(IMPORT_TIME)} - {"PYTHONPATH"}
        if not all(env.get(k) == self.env.get(k) for k in keys):
            return False
        # a PYTHONPATH of its own is put in sys.path by the child, unless it holds what the
        # interpreter runs at start-up
        return not any(os.path.exists(os.path.join(p, f"{name}.py"))
                       for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
                       for name in ("sitecustomize", "usercustomize"))


_zygote = None
_lock = threading.Lock()


def _classify(argv):
    """(kind, arg, rest) of a command the zygote can run as the interpreter would, or None."""
    argv = [os.fspath(a) for a in argv]
    if not argv:
        return None
    exe = argv[0]
    if exe == sys.executable and len(argv) >= 3 and argv[1] in ("-c", "-m"):
        return argv[1][1], argv[2], argv[3:]
    if os.path.dirname(exe) == os.path.dirname(sys.executable) and os.path.isfile(exe):
        with open(exe, "rb") as f:
            first = f.readline()
        if first.strip() == b"#!" + sys.executable.encode():      # a console script of this environment
            return "path", exe, argv[1:]
    return None


def _zygote_for(argv, env):
    """(zygote, (kind, arg, rest)) to fork ``argv`` from, or None where a new interpreter must run it."""
    global _zygote
    how = _classify(argv)
    if how is None or os.environ.get("KILN_TEST_FORKSERVER") == "0" or sys.platform != "linux":
        return None
    kind, arg, _ = how
    if kind == "c" and not any(name in arg for name in ("torch", "kiln", "tests")):
        return None                 # code that may never import torch: a child would have it imported
    with _lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = _Zygote()
        zygote = _zygote
    return (zygote, how) if zygote.serves(env) else None


def _start(zygote, how, cwd, env, fds):
    """Fork one child of ``zygote``; (connection, pid): the connection then says its exit status."""
    kind, arg, rest = how
    req = json.dumps({"kind": kind, "arg": arg, "argv": rest, "cwd": cwd, "env": env}).encode() + b"\n"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(zygote.path)
    socket.send_fds(s, [req], fds)
    return s, json.loads(_line(s, None))["pid"]


def run(argv, *, cwd=None, env=None, timeout=None, input=None, text=True, check=False, capture_output=True,
        **kwargs):
    """:func:`subprocess.run` with ``capture_output=True`` for ``argv``, forked from the zygote
    where it can be (see the module's docstring), else through :func:`subprocess.run` itself."""
    assert capture_output, "tests.forkserver.run always captures the output"
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd or os.getcwd())
    cmd = [os.fspath(a) for a in argv]
    fork = None if kwargs else _zygote_for(cmd, env)
    if fork is None:
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, input=input, text=text, check=check,
                              capture_output=True, **kwargs)
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if input is not None:
            stdin.write(input.encode() if isinstance(input, str) else input)
            stdin.seek(0)
        s, pid = _start(*fork, cwd, env, [stdin.fileno(), out.fileno(), err.fileno()])
        with s:
            line = _line(s, timeout)
            if line is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _line(s, 30)
            status = json.loads(line)["status"] if line else None
        outs = []
        for f in (out, err):
            f.seek(0)
            data = f.read()
            outs.append(data.decode(errors="replace") if text else data)
    if status is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=outs[0], stderr=outs[1])
    done = subprocess.CompletedProcess(cmd, status, outs[0], outs[1])
    if check:
        done.check_returncode()
    return done


class Popen:
    """The part of :class:`subprocess.Popen` the tests' servers use (``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``) for a child of the zygote;
    :func:`popen` makes one, or a real ``subprocess.Popen`` where the zygote cannot serve.
    Its streams are files or ``subprocess.DEVNULL`` (no pipes); it dies with the test process."""

    def __init__(self, conn, pid, args):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn, self._done = conn, threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        try:
            line = _line(self._conn, None)
            self.returncode = json.loads(line)["status"]
        except (OSError, RuntimeError, ValueError):
            self.returncode = -signal.SIGKILL        # the zygote is gone, and its children with it
        finally:
            self._conn.close()
            self._done.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _die_with_parent():
    """In a new interpreter's child before exec: SIGTERM when the test process dies (a worker
    killed by the OOM killer or a timeout left its servers running, holding gigabytes). A
    child of the zygote dies with the zygote, which ends with the test process."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))      # PR_SET_PDEATHSIG


def popen(argv, *, stdin=None, stdout=None, stderr=None, cwd=None, env=None, **kwargs):
    """``subprocess.Popen(argv, ...)`` forked from the zygote where it can be (streams: None,
    ``subprocess.DEVNULL`` or a file; no ``kwargs``), else ``subprocess.Popen`` itself; either
    way the child dies with the test process."""
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd or os.getcwd())
    cmd = [os.fspath(a) for a in argv]
    streams = (stdin, stdout, stderr)
    fork = None
    if not kwargs and all(x is None or x == subprocess.DEVNULL or hasattr(x, "fileno") for x in streams):
        fork = _zygote_for(cmd, env)
    if fork is None:
        if sys.platform.startswith("linux"):
            kwargs.setdefault("preexec_fn", _die_with_parent)
        return subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env, **kwargs)
    with open(os.devnull, "r+b") as null:
        fds = [null.fileno() if x == subprocess.DEVNULL else i if x is None else x.fileno()
               for i, x in enumerate(streams)]
        conn, pid = _start(*fork, cwd, env, fds)
    return Popen(conn, pid, cmd)


def _line(s: socket.socket, timeout):
    """One newline-ended message from ``s``, or None after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        ready, _, _ = select.select([s], [], [], left)
        if not ready:
            return None
        chunk = s.recv(4096)
        if not chunk:
            raise RuntimeError("the test zygote closed the connection")
        data += chunk
    return data
