"""A real sshd on loopback (127.0.0.2 and 127.0.0.3, two "hosts"): the ``sshd`` fixture and
the ``tfdp-run --address`` flags that name the hosts, shared by the test modules that start
workers over ssh (test modules import it from here, never from one another)."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from launching import run_job, worker_env, worker_script

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)

def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))  # free on every address, 127.0.0.4 included
        return s.getsockname()[1]


def _reachable(address, port):
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.2 and 127.0.0.3; yields the ssh_config that reaches it."""
    if SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH server/client not installed (apt-get install openssh-server "
                    "openssh-client; CI installs them)")
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                       check=True, timeout=30)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = _free_port()
    (d / "sshd_config").write_text(
        f"ListenAddress 127.0.0.2:{port}\nListenAddress 127.0.0.3:{port}\n"
        f"HostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n")
    (d / "ssh_config").write_text(
        "Host tfdp-a\n  HostName 127.0.0.2\nHost tfdp-b\n  HostName 127.0.0.3\n"
        "Host tfdp-down\n  HostName 127.0.0.4\n"
        f"Host *\n  Port {port}\n  IdentityFile {d / 'client_key'}\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # Debian's sshd needs its privilege-separation dir
    log = open(d / "sshd.log", "w")
    server = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (_reachable("127.0.0.2", port) and _reachable("127.0.0.3", port)):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"sshd did not start: {(d / 'sshd.log').read_text()}")
            time.sleep(0.05)  # polling a port; the deadline bounds it
        yield str(d / "ssh_config")
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


ADDRESSES = ("--address", "tfdp-a=127.0.0.2", "--address", "tfdp-b=127.0.0.3")


def launch_over_ssh(tmp_path, sshd, script, timeout=180, **env):
    """``tfdp-run -np 2 -H tfdp-a:1,tfdp-b:1`` (this module's loopback sshd, two
    "hosts" on 127.0.0.2 and 127.0.0.3), horovodrun's spelling; ``env`` passed with -x."""
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, TMPDIR=tmp_path, **env)
    passed = [flag for name in env for flag in ("-x", name)]
    cmd = [sys.executable, "-m", "tfdp.run", "-np", "2", "-H", "tfdp-a:1,tfdp-b:1",
           "--ssh-config", sshd, *ADDRESSES, *passed, "--output", "all",
           sys.executable, worker_script(script)]
    code, out = run_job(cmd, environ, timeout)
    assert code == 0, out[-4000:]
    return out
