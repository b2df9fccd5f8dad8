"""``batchgen redis status|stop``: the embedded Redis seen and stopped by a user, with a
real worker process on it; a stop loses nothing (the next command starts it again)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from batchgen.jobs.redis import embedded
from tests.cli_session import Shell, wait_for, write_jsonl


def test_status_and_stop_of_the_embedded_redis(tmp_path: Path, toy_model):
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    home = tmp_path / "home"
    shell = Shell(tmp_path, home)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "max_tokens": 2} for i in range(3)])
    try:
        not_running = (f"embedded Redis  not running (data in {home / 'redis'}; the next batchgen "
                       "command that needs it starts it)\n")  # fmt: skip
        assert shell.ok("redis", "status") == not_running
        assert shell.ok("redis", "stop") == "the embedded Redis is not running\n"

        shell.ok("submit", "p.jsonl", "--model", "tiny", "--job-id", "a")
        pid = embedded.server_pid(home)
        lines = shell.ok("redis", "status").splitlines()
        assert lines[0] == f"embedded Redis  running, pid {pid}, unix://{home}/redis/redis.sock"
        assert re.fullmatch(rf"data            {home}/redis \([\d,]+ bytes of AOF\)", lines[1])
        assert lines[2:] == ["jobs            1 not finished, 0 finished",
                             "workers         0 live; 0 other connection(s)"]  # fmt: skip

        worker = shell.start("worker", "--model", "tiny", "--device", "cpu")
        wait_for(lambda: shell.status("a")["state"] == "completed", "the job to finish")
        out = shell.run("redis", "stop")
        assert out.returncode == 1 and out.stdout == ""
        assert re.fullmatch(
            r"batchgen: error: the embedded Redis is in use \(1 live worker\(s\); \d+ "
            r"connection\(s\) of workers, batchgen run, serve or status --watch; 0 job\(s\) not "
            r"finished\): stop those first, or pass --force\n",
            out.stderr,
        ), out.stderr
        assert embedded.running_url(home) is not None  # refused: still there
        assert shell.ok("redis", "stop", "--force") == f"stopped the embedded Redis (pid {pid})\n"
        assert embedded.running_url(home) is None
        os.killpg(worker.pid, signal.SIGKILL)  # it lost its Redis: it would wait, then fail
        worker.wait()

        shell.ok("submit", "p.jsonl", "--model", "tiny", "--job-id", "b")  # starts it again
        assert shell.status("a")["state"] == "completed"  # the AOF kept everything
        new_pid = embedded.server_pid(home)
        # the killed worker's heartbeat came back with the AOF (it expires in 45 s), but
        # nothing is connected: the stop is not refused for it
        assert shell.ok("redis", "stop") == (
            f"stopped the embedded Redis (pid {new_pid}); 1 unfinished job(s) wait in its AOF "
            "for the next start\n"
        )
        assert shell.ok("redis", "status") == not_running
        assert shell.status("b")["state"] == "queued"  # started again, the job kept
    finally:
        shell.stop_all()
        embedded.stop(home)
