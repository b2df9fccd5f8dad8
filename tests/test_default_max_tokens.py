"""A line without max_tokens gets OpenAI's default for its kind, through the CLI: a chat
line runs to the end of its answer or of the context, a prompt line stops at 16 tokens."""

from __future__ import annotations

from pathlib import Path

from tests.cli_session import Shell, rows, write_jsonl

CONTEXT = 48  # the run's --max-model-len: a chat answer that never ends fills it


def test_chat_lines_run_to_the_context_and_prompt_lines_stop_at_16(tmp_path: Path, toy_model):
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    chat = [{"role": "user", "content": "hello"}]
    # ignore_eos: the toy's gibberish ends where its limit is, never earlier by chance
    write_jsonl(tmp_path / "p.jsonl", [
        {"id": "chat", "messages": chat, "ignore_eos": True},
        {"id": "prompt", "prompt": "hello", "ignore_eos": True},
        {"custom_id": "oa-chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": chat, "ignore_eos": True}},
        {"custom_id": "oa-prompt", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hello", "ignore_eos": True}},
        {"id": "chat-own", "messages": chat, "ignore_eos": True, "max_tokens": 5},
    ])  # fmt: skip
    shell = Shell(tmp_path, tmp_path / "home")
    out = shell.run("run", "p.jsonl", "--model", "tiny", "-o", "out.parquet", "--device", "cpu",
                    "--max-model-len", str(CONTEXT))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = rows(tmp_path / "out.parquet")
    assert got["id"] == ["chat", "prompt", "oa-chat", "oa-prompt", "chat-own"]
    assert got["finish_reason"] == ["length"] * 5
    prompts, outputs = got["prompt_tokens"], got["completion_tokens"]
    assert prompts[0] == prompts[2] and prompts[0] + 16 < CONTEXT  # room past 16 tokens
    # the chat lines fill the context; the prompt lines stop at 16; a line's own max_tokens wins
    assert outputs == [CONTEXT - prompts[0], 16, CONTEXT - prompts[2], 16, 5]
    assert [len(ids) for ids in got["token_ids"]] == outputs

    # a job's --max-tokens is every line's without its own, chat lines' too
    again = shell.run("run", "p.jsonl", "--model", "tiny", "-o", "again.parquet",
                      "--device", "cpu", "--max-model-len", str(CONTEXT), "--max-tokens", "20")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert rows(tmp_path / "again.parquet")["completion_tokens"] == [20, 20, 20, 20, 5]
