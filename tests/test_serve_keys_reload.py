"""The keys file read again while ``batchgen serve`` runs: on SIGHUP, and on a change
of the file; a removed key and its dashboard session are refused at once, a broken
new file keeps the keys in force (one log line). Tried on a real server process with
the official ``openai`` client and urllib."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from batchgen.serve.api_keys import FILE_CHECK_S
from tests.serve_stack import Stack, private_stack


def client(stack: Stack, key: str) -> OpenAI:
    return OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0)


def allowed(stack: Stack, key: str) -> bool:
    """Whether ``key`` is one of the server's keys now (a 200 or a 401 from /v1/batches)."""
    try:
        client(stack, key).batches.list()
    except openai.AuthenticationError:
        return False
    return True


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object) -> None:
        return None


def session_of(stack: Stack, key: str) -> str:
    """The dashboard session cookie of a browser signed in with ``key``."""
    form = urllib.parse.urlencode({"key": key}).encode()
    request = urllib.request.Request(stack.base + "/login", data=form,
                                     headers={"Origin": stack.base})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as redirect:
        urllib.request.build_opener(_NoRedirect).open(request, timeout=10)
    assert redirect.value.code == 303
    return redirect.value.headers["set-cookie"].split(";")[0]


def jobs_seen(stack: Stack, cookie: str) -> int:
    """The status of the dashboard's /api/jobs for the session ``cookie``."""
    request = urllib.request.Request(stack.base + "/api/jobs", headers={"Cookie": cookie})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def hup(stack: Stack) -> None:
    assert stack.server is not None
    os.kill(stack.server.pid, signal.SIGHUP)
    time.sleep(0.5)  # the handler runs in the server's main thread, at once


def test_a_removed_key_and_its_session_are_refused_after_sighup_or_a_change(tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-a team-a\nsk-b team-b\n")
    with private_stack(tmp_path, tmp_path) as stack:
        stack.serve("--keys-file", str(keys))
        cookie = session_of(stack, "sk-b")
        assert jobs_seen(stack, cookie) == 200
        assert (allowed(stack, "sk-a"), allowed(stack, "sk-b"), allowed(stack, "sk-c")) == (
            True, True, False
        )  # fmt: skip

        keys.write_text("sk-a team-a\nsk-c team-c\n")  # sk-b removed, sk-c added
        hup(stack)
        assert (allowed(stack, "sk-a"), allowed(stack, "sk-b"), allowed(stack, "sk-c")) == (
            True, False, True
        )  # fmt: skip
        assert jobs_seen(stack, cookie) == 401

        keys.write_text("sk-a team-a\n")  # no signal: the change itself is seen
        time.sleep(FILE_CHECK_S + 0.2)
        assert (allowed(stack, "sk-a"), allowed(stack, "sk-c")) == (True, False)

        keys.write_text("sk-a team-a\nsk-d team-d extra words\n")  # invalid: kept as it was
        hup(stack)
        time.sleep(FILE_CHECK_S + 0.2)
        assert (allowed(stack, "sk-a"), allowed(stack, "sk-d")) == (True, False)
        keys.unlink()  # unreadable: kept as it was
        hup(stack)
        time.sleep(FILE_CHECK_S + 0.2)
        assert (allowed(stack, "sk-a"), allowed(stack, "sk-d")) == (True, False)
        log = stack.log(stack.server_log)
        assert [line for line in log.splitlines() if "keeping the" in line] == [
            f"--keys-file {keys}, line 2: write KEY TENANT, or KEY TENANT admin; keeping the "
            "1 keys in force",
            f"--keys-file {keys}: cannot read it ([Errno 2] No such file or directory: "
            f"'{keys}'); keeping the 1 keys in force",
        ]
