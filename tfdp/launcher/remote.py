"""The remote half of tfdp-run's ssh launch. Runs on the worker's host; standard library only.

tfdp-run does not need tfdp, or anything, installed for this file on the remote host: it runs
``ssh HOST PYTHON -c BOOTSTRAP`` and sends this file's source as the first line of ssh's stdin
(:func:`tfdp.launcher.processes.remote_command`). The rest of the exchange:

stdin, the next line: the job, one JSON object --
    ``{"mode": "probe", "ports": N, "interface": IFACE or null}``: print
    ``{"ports": [N free TCP ports], "address": IFACE's IPv4 address or null}`` and exit 0;
    ``{"mode": "run", "command": [...], "cwd": DIR, "env": {...}, "host": NAME,
    "private_env": {VAR: FILE}, "watch": [FILE, ...]}``: run the worker (below).
stdin, later lines: signal names (``SIGTERM``, ``SIGINT``, ``SIGCONT``, ``SIGKILL``) for the
    worker's process group, or ``{"file": NAME, "text": TEXT}``: a control file tfdp-run
    writes for the worker (``peer-exited.json``), written atomically into its private
    directory (NAME a plain file name). **At EOF** (tfdp-run ended, or its ssh was killed)
    the worker's group is SIGKILLed: a worker never outlives its launcher.
stdout: the worker's stdout and stderr, merged, untouched.
stderr: ``tfdp-remote {json}`` lines for tfdp-run -- ``{"started": PID}`` once the worker runs,
    ``{"file": FILE, "text": TEXT}`` whenever a watched control file appears or changes and
    once more after the worker exits; any other line is a message for the user.
exit code: the worker's (128 + N if a signal N ended it); 127 if it could not start.

The worker's control files go to a private directory on its host (each ``private_env`` variable
points into it: ``""`` the directory, else that file in it), removed at the end; tfdp-run
writes what is relayed into its own control directory. So no shared filesystem is needed.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

MARK = "tfdp-remote "
_POLL_SECONDS = 0.05
_tell_lock = threading.Lock()


def tell(message):
    with _tell_lock:
        sys.stderr.write(MARK + json.dumps(message) + "\n")
        sys.stderr.flush()


def _ephemeral_ports() -> tuple:
    """The kernel's range of ports for outbound connections and ``bind(0)`` (Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(word) for word in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


# Ports are drawn at random from below the ephemeral range: a port the kernel hands out there
# (bind(0), or the local port of any outbound connection, such as another job's gRPC client)
# can be taken by someone else between this choice and the worker's own bind, which failed a
# worker with "Could not start gRPC server" in a CI run with other jobs on the host. Below the
# range only another explicit bind can take it. Where the range starts too low to leave room,
# the kernel chooses, as before.
_LOWEST_PORT = 10000


def free_ports(count, host="", avoid=()):
    """``count`` distinct TCP ports free on ``host`` ("": every interface), held open together,
    none of them in ``avoid`` (the previous attempt's: a restart gets fresh ports even where
    the kernel would hand the same one out again), drawn from below the kernel's ephemeral
    range (see above)."""
    import random

    avoid, sockets, ports = set(avoid), [], []
    low = _ephemeral_ports()[0]
    draws = random.Random()
    tries = 0
    try:
        while len(ports) < count:
            if len(sockets) >= count + min(len(avoid), 192) + 64:  # bounded: fds are finite
                raise OSError(f"no {count} free ports outside {sorted(avoid)} on {host or 'any'}")
            tries += 1
            below = low - _LOWEST_PORT > 1000 and tries <= 256
            port = draws.randint(_LOWEST_PORT, low - 1) if below else 0
            if port and (port in avoid or port in ports):
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                if not port:
                    raise
                continue
            sockets.append(s)
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in sockets:
            s.close()


def interface_address(name):
    """The IPv4 address of network interface ``name`` (Linux), or SystemExit naming the choices."""
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError) as e:
        try:
            names = sorted(n for _, n in socket.if_nameindex())
        except OSError:
            names = []
        raise SystemExit(f"tfdp-run: host {socket.gethostname()}: no IPv4 address for network "
                         f"interface {name!r} ({e}); interfaces here: {names}. Give another "
                         "--network-interface, or --address HOST=ADDR") from None


def write_control_file(directory, line):
    """Writes the control file a ``{"file": NAME, "text": TEXT}`` line from tfdp-run carries
    into ``directory`` (atomically: the worker polls for it); anything else is ignored."""
    try:
        message = json.loads(line)
        name, text = message["file"], message["text"]
    except (ValueError, KeyError, TypeError):
        return
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name[0] == ".":
        return
    path = os.path.join(directory, name)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(str(text))
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def relay_signals(proc, stdin, private=None):
    """Signal names from stdin to the worker's process group, control files into ``private``;
    EOF kills the group."""
    for raw in stdin:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("{"):
            if private is not None:
                write_control_file(private, line)
            continue
        sig = getattr(signal, line, None)
        if isinstance(sig, signal.Signals) and proc.returncode is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def watch_files(directory, names, done):
    """Tells tfdp-run each watched file's text when it appears or changes, until ``done``."""
    seen = {}

    def scan():
        for name in names:
            try:
                with open(os.path.join(directory, name)) as f:
                    text = f.read()
            except OSError:
                continue
            if seen.get(name) != text:
                seen[name] = text
                tell({"file": name, "text": text})

    while not done.wait(_POLL_SECONDS):
        scan()
    scan()  # the worker has exited: its last files are complete


def run(job, stdin):
    host = job.get("host", socket.gethostname())
    try:
        os.chdir(job["cwd"])
    except OSError as e:
        print(f"tfdp-run: host {host}: cannot change to the working directory {job['cwd']!r} "
              f"({e}); tfdp-run runs every worker in the directory it was started from",
              file=sys.stderr, flush=True)
        return 127
    private = tempfile.mkdtemp(prefix="tfdp-remote-")
    env = dict(os.environ)
    env.update(job["env"])
    for var, name in job.get("private_env", {}).items():
        env[var] = os.path.join(private, name) if name else private
    try:
        proc = subprocess.Popen(job["command"], env=env, stdin=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        print(f"tfdp-run: host {host}: cannot start the worker command {job['command'][0]!r} "
              f"({e}); check the command after '--' (and that it is on PATH there)",
              file=sys.stderr, flush=True)
        shutil.rmtree(private, ignore_errors=True)
        return 127
    tell({"started": proc.pid})
    done = threading.Event()
    threading.Thread(target=relay_signals, args=(proc, stdin, private), daemon=True).start()
    watcher = threading.Thread(target=watch_files, args=(private, job.get("watch", ()), done),
                               daemon=True)
    watcher.start()
    code = proc.wait()
    done.set()
    watcher.join()
    shutil.rmtree(private, ignore_errors=True)
    return 128 - code if code < 0 else code


def main():
    stdin = sys.stdin.buffer
    job = json.loads(stdin.readline())
    if job["mode"] == "probe":
        address = job.get("interface") and interface_address(job["interface"])
        ports = free_ports(job["ports"], avoid=job.get("avoid", ()))
        print(json.dumps({"ports": ports, "address": address}), flush=True)
        return 0
    return run(job, stdin)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the signal relay thread is blocked reading stdin, and interpreter shutdown
    # would wait for the lock it holds on sys.stdin.buffer.
    os._exit(code)
