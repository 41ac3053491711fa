"""Starting gloo ranks for the moefold_torch tests: plain processes (torch's spawn kills the
survivors when one exits), one result line each, a wall-clock limit (a hang fails the case
instead of the suite), and a doctest-style summary that scripts/count_tests.py counts."""
import datetime
import json
import os
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, scenario, world, limit_s, extra=()):
    """Runs `script --worker SCENARIO RANK WORLD PORT [extra...]` on `world` ranks. Returns
    ([{rc, result, stderr}] by rank, hung)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, script, "--worker", scenario, str(r), str(world),
                               str(port), *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    deadline = time.monotonic() + limit_s
    results, hung = [], False
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            o, e = p.communicate()
        res = None
        for line in o.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
        results.append({"rc": p.returncode, "result": res, "stderr": e[-1500:]})
    return results, hung


def join(rank, world, port, timeout_s):
    """This worker joins the gloo group of the job (TCP on loopback)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def report(out):
    """The worker's result line; then the process ends without tearing gloo down (after a
    failure its state is unknown)."""
    print("RESULT " + json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)


class Cases:
    """Named pass/fail cases and the summary line."""

    def __init__(self):
        self.passed = self.failed = 0

    def check(self, name, ok, detail=""):
        if ok:
            self.passed += 1
            print(f"[ok] {name}")
        else:
            self.failed += 1
            print(f"[FAIL] {name}: {detail}")

    def finish(self):
        total = self.passed + self.failed
        print(f"[doctest] test cases: {total} | {self.passed} passed | {self.failed} failed | "
              "0 skipped")
        return 1 if self.failed else 0


def skip_without_torch():
    """Exit 77 (meson's skip) when torch or moefold_torch does not import."""
    try:
        import torch  # noqa: F401
        import moefold_torch  # noqa: F401
    except ImportError as e:
        print(f"no torch or moefold_torch ({e}): skipped")
        sys.exit(77)
