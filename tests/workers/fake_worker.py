"""A TensorFlow-free stand-in for a tfdp worker, for tfdp-run's process tests.

It speaks the launcher protocol of tfdp.protocol the way a real worker does: it "joins" (writes
its ready file), waits for every peer of its attempt to join (as the first collective would;
through FAKE_OUT, which tests share between "hosts": a worker's control directory is private
to it when tfdp-run starts it over ssh),
"completes its first step" (writes its progress file), then acts. What it does is chosen per
slot and attempt by FAKE_PLAN, a JSON object whose keys are "slot@attempt" with "*" as a
wildcard (lookup order: "s@a", "s@*", "*@a", "*@*"; default "ok"):

    ok                  join, barrier, progress, exit 0
    exit:N              join, barrier, progress, exit N ("crashed mid-training")
    kill                join, barrier, progress, SIGKILL itself
    crash:N             exit N at once, before joining ("fails at every start")
    never-join          never write the ready file; wait for a signal
    wait-for-peers      start joining (the ".joining" file), never join, ignore SIGTERM: a
                        worker waiting for its peers in the strategy constructor
    crash-when-waited:N exit N before joining, once every other rank waits for its peers
    block               join, barrier, progress, wait for a signal
    ignore-term         like block, but SIGTERM is only recorded, not obeyed
    evict:R             join, barrier, progress; the chief writes evict.json naming rank R;
                        every worker exits 75 (or TFDP_EVICT_EXIT_CODE)
    sleep-exit:S:N      join, sleep S seconds (the behaviour under test), exit N
    chatty:L:N          join, barrier, progress, print "line 0" .. "line L-1", exit N

SIGTERM is recorded and answered with exit 143 (as tfdp's preemption callback does after its
backup); SIGINT with exit 130. Everything the worker saw goes to FAKE_OUT as
start-s{slot}-a{attempt}.json; signals as {signal}-s{slot}-a{attempt} (the n-th receipt of
the same signal: ...-a{attempt}-{n}); "stepped" after the first step. SIGALRM after
FAKE_LIFETIME seconds (default 60) ends a worker that nobody stops.
"""

import json
import os
import signal
import sys
import time

from tfdp.protocol import (ATTEMPT_ENV, CONTROL_DIR_ENV, EVICT_FILE, EXIT_PREEMPTED,
                           GRACE_ENV, MIN_WORKERS_ENV, RANK_ENV,
                           READY_FILE_ENV, RESTARTS_LEFT_ENV, SLOT_ENV, progress_file,
                           restart_requested_exit_code)

OUT = os.environ["FAKE_OUT"]
SLOT = int(os.environ[SLOT_ENV])
ATTEMPT = int(os.environ[ATTEMPT_ENV])
RANK = int(os.environ[RANK_ENV])
CONTROL_DIR = os.environ[CONTROL_DIR_ENV]
TF_CONFIG = json.loads(os.environ["TF_CONFIG"])
NUM_WORKERS = len(TF_CONFIG["cluster"]["worker"])
TAG = f"s{SLOT}-a{ATTEMPT}"


def write_atomically(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # tests poll for these files: never let them see half a file


_received = {}


def record_signal(name):
    """The first receipt is {name}-{tag}, the n-th {name}-{tag}-{n}."""
    n = _received[name] = _received.get(name, 0) + 1
    suffix = "" if n == 1 else f"-{n}"
    write_atomically(os.path.join(OUT, f"{name}-{TAG}{suffix}"), str(os.getpid()))


def on_term(signum, frame):
    record_signal("SIGTERM")
    os._exit(EXIT_PREEMPTED)


def on_int(signum, frame):
    record_signal("SIGINT")
    os._exit(130)


def action():
    plan = json.loads(os.environ.get("FAKE_PLAN", "{}"))
    for key in (f"{SLOT}@{ATTEMPT}", f"{SLOT}@*", f"*@{ATTEMPT}", "*@*"):
        if key in plan:
            return plan[key]
    return "ok"


def joined_file(rank):
    return os.path.join(OUT, f"joined-a{ATTEMPT}-r{rank}")


def waiting_file(rank):
    return os.path.join(OUT, f"waiting-a{ATTEMPT}-r{rank}")


def start_joining():
    """What the strategy constructor writes first: this worker is waiting for its peers."""
    with open(os.environ[READY_FILE_ENV] + ".joining", "w"):
        pass


def join():
    start_joining()
    with open(os.environ[READY_FILE_ENV], "w"):
        pass
    with open(joined_file(RANK), "w"):
        pass


def barrier():
    """Wait until every rank of this attempt has joined (a real first step needs them all)."""
    paths = [joined_file(r) for r in range(NUM_WORKERS)]
    while not all(os.path.exists(p) for p in paths):
        time.sleep(0.005)  # polling a file; FAKE_LIFETIME's SIGALRM bounds it


def first_step():
    join()
    barrier()
    with open(progress_file(CONTROL_DIR, RANK), "w"):
        pass
    write_atomically(os.path.join(OUT, f"stepped-{TAG}"), str(os.getpid()))


def wait_for_signals():
    while True:
        signal.pause()


def main():
    what = action()
    if what in ("ignore-term", "wait-for-peers"):
        signal.signal(signal.SIGTERM, lambda signum, frame: record_signal("SIGTERM"))
    else:
        signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)
    signal.alarm(int(os.environ.get("FAKE_LIFETIME", "60")))
    record = {"pid": os.getpid(), "slot": SLOT, "attempt": ATTEMPT, "rank": RANK,
              "action": what, "tf_config": TF_CONFIG, "control_dir": CONTROL_DIR,
              "min_workers": os.environ.get(MIN_WORKERS_ENV),
              "restarts_left": os.environ.get(RESTARTS_LEFT_ENV),
              "grace": os.environ.get(GRACE_ENV), "cwd": os.getcwd(),
              "env": {k: os.environ.get(k) for k in ("TF_CPP_MIN_LOG_LEVEL", "FAKE_EXTRA")}}
    write_atomically(os.path.join(OUT, f"start-{TAG}.json"), json.dumps(record))
    print(f"fake worker slot {SLOT} rank {RANK} attempt {ATTEMPT}: {what}", flush=True)
    name, _, arg = what.partition(":")
    if name == "crash":
        sys.exit(int(arg))
    if name == "never-join":
        wait_for_signals()
    if name == "wait-for-peers":
        start_joining()
        write_atomically(waiting_file(RANK), "")
        wait_for_signals()
    if name == "crash-when-waited":
        others = [waiting_file(r) for r in range(NUM_WORKERS) if r != RANK]
        while not all(os.path.exists(p) for p in others):
            time.sleep(0.005)  # polling a file; FAKE_LIFETIME's SIGALRM bounds it
        sys.exit(int(arg))
    if name == "sleep-exit":
        join()
        seconds, _, code = arg.partition(":")
        time.sleep(float(seconds))
        sys.exit(int(code))
    first_step()
    if name == "ok":
        sys.exit(0)
    if name == "chatty":
        lines, _, code = arg.partition(":")
        for i in range(int(lines)):
            print(f"line {i}", flush=True)
        sys.exit(int(code))
    if name == "exit":
        sys.exit(int(arg))
    if name == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "block":
        wait_for_signals()
    if name == "ignore-term":
        wait_for_signals()
    if name == "evict":
        if RANK == 0:
            write_atomically(os.path.join(CONTROL_DIR, EVICT_FILE),
                             json.dumps({"rank": int(arg), "reason": "fake straggler"}))
        sys.exit(restart_requested_exit_code())
    raise SystemExit(f"fake_worker: unknown action {what!r}")


if __name__ == "__main__":
    main()
