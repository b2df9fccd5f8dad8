"""Table input: Parquet and CSV files, folders and s3:// URIs become queue entries
with the checks of a JSONL line; compressed JSONL; errors by row and column."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.intake.table_spec import TableSpec, parse_sampling_columns
from batchgen.jobs.intake.template import parse
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.errors import InvalidInput, JobConflict, UsageError
from batchgen.jobs.schema.sampling import DEFAULTS

KEYS = Keys("bg")


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def run(conn, source, tmp_path, job_id="t1", **kw):
    kw.setdefault("output", str(tmp_path / f"out-{job_id}"))
    return submit(conn, KEYS, source_path=str(source), model="m", defaults=dict(DEFAULTS),
                  job_id=job_id, **kw)  # fmt: skip


# an entry's sampling when its row sets none: a prompt gets 16 tokens, chat runs to its end
PROMPT = {"max_tokens": 16, **DEFAULTS}
CHAT = {"max_tokens": None, **DEFAULTS}


def entries(conn, job_id="t1") -> list[dict[str, Any]]:
    return [json.loads(r) for _, _, r in backlog.queued(conn, KEYS.queue_for_model("m"), job_id)]


def docs() -> pa.Table:
    return pa.table({
        "doc": pa.array(["d-a", "d-b", "d-c"]),
        "title": ["Cats", "Dogs {x}", "Owls"],
        "body": ["purr", "woof", None],
        "max_tokens": pa.array([5, None, 7], pa.int64()),
        "temperature": [0.5, 0.0, 1.0],
        "seed": pa.array([1, 2, None], pa.int64()),
    })  # fmt: skip


def test_parquet_template_sampling_columns_and_id_column(redis_url, tmp_path):
    table = docs().slice(0, 2)
    pq.write_table(table, tmp_path / "docs.parquet")
    spec = TableSpec(
        template="Summarise: {title}\n{body} {{x}}",
        id_column="doc",
        sampling_columns=parse_sampling_columns("max_tokens,temperature,seed"),
    )
    result = run(rconn(redis_url), tmp_path / "docs.parquet", tmp_path, table=spec)
    assert (result.total, result.enqueued_now, result.skipped) == (2, 2, 0)
    # a value holding "{x}" is inserted as it is, never expanded
    assert entries(rconn(redis_url)) == [
        {"id": "d-a", "p": "Summarise: Cats\npurr {x}",
         "s": {**PROMPT, "max_tokens": 5, "temperature": 0.5, "seed": 1}},
        {"id": "d-b", "p": "Summarise: Dogs {x}\nwoof {x}",
         "s": {**PROMPT, "temperature": 0.0, "seed": 2}},
    ]  # fmt: skip
    record = load_job(rconn(redis_url), KEYS, "t1")
    assert (record.input_format, record.kept_columns, record.total) == ("parquet", [], 2)


def test_csv_folder_in_name_order_with_row_numbers_as_ids(redis_url, tmp_path):
    folder = tmp_path / "qs"
    (folder / "sub").mkdir(parents=True)
    pacsv.write_csv(pa.table({"q": ["c1", "c2"]}), folder / "sub" / "b.csv")
    pacsv.write_csv(pa.table({"q": ["a1"]}), folder / "a.csv")
    (folder / "_SUCCESS").write_text("")
    (folder / ".hidden.txt").write_text("x")
    result = run(rconn(redis_url), folder, tmp_path, table=TableSpec(prompt_column="q"))
    assert result.total == 3
    assert [(e["id"], e["p"]) for e in entries(rconn(redis_url))] == [
        ("0", "a1"), ("1", "c1"), ("2", "c2")]  # fmt: skip


def test_messages_column_with_names_and_a_logit_bias_map(redis_url, tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    chat = pa.array(
        [[{"role": "system", "content": "Be brief.", "name": None},
          {"role": "user", "content": "Hi", "name": "ann"}],
         [{"role": "user", "content": "Bye", "name": None}]],
        pa.list_(message),
    )  # fmt: skip
    bias = pa.array([[(5, 1.5)], None], pa.map_(pa.int64(), pa.float64()))
    pq.write_table(pa.table({"chat": chat, "n": [1, 2], "logit_bias": bias}),
                   tmp_path / "c.parquet")  # fmt: skip
    mapped = parse_sampling_columns("n,logit_bias")
    run(rconn(redis_url), tmp_path / "c.parquet", tmp_path,
        table=TableSpec(messages_column="chat", sampling_columns=mapped))  # fmt: skip
    assert entries(rconn(redis_url)) == [
        {"id": "0", "m": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi", "name": "ann"}],
         "s": {**CHAT, "n": 1, "logit_bias": {"5": 1.5}}},
        {"id": "1", "m": [{"role": "user", "content": "Bye"}], "s": {**CHAT, "n": 2}},
    ]  # fmt: skip


def test_template_values_other_than_strings(redis_url, tmp_path):
    import datetime as dt

    table = pa.table({
        "k": pa.array([7], pa.int32()), "x": [0.25], "tags": [["a", "b"]],
        "at": pa.array([dt.datetime(2024, 5, 6, 7, 8, 9)], pa.timestamp("s")),
        "day": pa.array([dt.date(2024, 5, 6)], pa.date32()),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "v.parquet")
    run(rconn(redis_url), tmp_path / "v.parquet", tmp_path,
        table=TableSpec(template="{k}|{x}|{tags}|{at}|{day}"))  # fmt: skip
    assert entries(rconn(redis_url))[0]["p"] == '7|0.25|["a", "b"]|2024-05-06T07:08:09|2024-05-06'


def test_bad_values_name_their_row_and_column_and_nothing_is_queued(redis_url, tmp_path):
    chat = pa.array(
        [[{"role": "user", "content": "ok"}], [{"role": "robot", "content": "x"}],
         [{"role": "user", "content": "ok"}], [{"role": "user", "content": "ok"}]],
        pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    )  # fmt: skip
    table = pa.table({"chat": chat, "max_tokens": pa.array([4, 4, 0, 4]),
                      "top_p": [1.0, 1.0, 1.0, 2.0]})  # fmt: skip
    pq.write_table(table, tmp_path / "bad.parquet")
    conn = rconn(redis_url)
    spec = TableSpec(messages_column="chat", sampling_columns=("max_tokens=max_tokens",
                                                                "top_p=top_p"))  # fmt: skip
    with pytest.raises(InvalidInput) as info:
        run(conn, tmp_path / "bad.parquet", tmp_path, table=spec)
    assert str(info.value) == (
        f"{tmp_path / 'bad.parquet'}: 3 invalid row(s); nothing was enqueued. Fix them, or pass "
        "--skip-invalid to submit only the valid rows.\n"
        "  row 1, column chat[0].role: role must be one of system, developer, user, assistant, "
        "tool\n"
        "  row 2, column max_tokens: max_tokens must be an integer from 1 to 1048576, got 0\n"
        "  row 3, column top_p: top_p must be a number in (0, 1], got 2.0"
    )
    assert conn.dbsize() == 0
    # a template over a null value names it too
    pq.write_table(docs(), tmp_path / "docs.parquet")
    with pytest.raises(InvalidInput, match=r"row 2, column body: null value where --template"):
        run(conn, tmp_path / "docs.parquet", tmp_path, table=TableSpec(template="{title} {body}"))
    assert conn.dbsize() == 0


def test_skip_invalid_keeps_every_row_at_its_number(redis_url, tmp_path):
    pq.write_table(docs(), tmp_path / "docs.parquet")
    result = run(rconn(redis_url), tmp_path / "docs.parquet", tmp_path, skip_invalid=True,
                 table=TableSpec(template="{title}: {body}"))  # fmt: skip
    assert (result.total, result.skipped, [str(e) for e in result.errors]) == (
        3, 1, ["row 2, column body: null value where --template needs one"])  # fmt: skip
    qk = KEYS.queue_for_model("m")
    queued = backlog.queued(rconn(redis_url), qk, "t1")
    assert [i for i, _, _ in queued] == [0, 1, 2]  # the invalid row keeps its place
    assert json.loads(queued[2][2]) == {
        "err": "row 2, column body: null value where --template needs one", "id": "2"}  # fmt: skip


def test_s3_parquet_folder_and_file(redis_url, tmp_path, s3_endpoint, monkeypatch):
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http")
    for name, rows in (("part-1.parquet", ["s3 b"]), ("part-0.parquet", ["s3 a"])):
        with fs.open_output_stream(f"batchgen-test/tables/{name}") as out:
            pq.write_table(pa.table({"text": rows}), out)
    uri = f"s3://batchgen-test/tables/?endpoint_override={s3_endpoint}&scheme=http"
    run(rconn(redis_url), uri, tmp_path, table=TableSpec(prompt_column="text"))
    assert [e["p"] for e in entries(rconn(redis_url))] == ["s3 a", "s3 b"]
    # a single object, the endpoint from AWS_ENDPOINT_URL
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_endpoint}")
    run(rconn(redis_url), "s3://batchgen-test/tables/part-1.parquet", tmp_path, job_id="t2",
        table=TableSpec(prompt_column="text"))  # fmt: skip
    assert [e["p"] for e in entries(rconn(redis_url), "t2")] == ["s3 b"]


def test_compressed_jsonl_gives_the_same_job_as_plain(redis_url, tmp_path):
    # zstd through pyarrow's codec: no extra dependency
    text = "".join(json.dumps({"id": f"r{i}", "prompt": f"p {i}"}) + "\n" for i in range(50))
    (tmp_path / "p.jsonl").write_text(text)
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    with pa.CompressedOutputStream(str(tmp_path / "p.jsonl.zst"), "zstd") as out:
        out.write(text.encode())
    conn = rconn(redis_url)
    shas = []
    for i, name in enumerate(("p.jsonl", "p.jsonl.gz", "p.jsonl.zst")):
        result = run(conn, tmp_path / name, tmp_path, job_id=f"j{i}")
        assert result.total == 50
        shas.append(load_job(conn, KEYS, f"j{i}").source_sha256)
        assert entries(conn, f"j{i}") == entries(conn, "j0")
    assert len(set(shas)) == 1
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UsageError, match=r"cannot read .*bad\.jsonl\.gz"):
        run(conn, tmp_path / "bad.jsonl.gz", tmp_path, job_id="j9")


def test_resubmit_is_resumed_and_other_kept_columns_are_another_job(redis_url, tmp_path):
    pq.write_table(docs(), tmp_path / "docs.parquet")
    conn = rconn(redis_url)
    spec = TableSpec(prompt_column="title", keep_columns=("doc",))
    first = run(conn, tmp_path / "docs.parquet", tmp_path, table=spec)
    again = run(conn, tmp_path / "docs.parquet", tmp_path, table=spec)
    assert (first.enqueued_now, again.enqueued_now, again.resumed) == (3, 0, True)
    other = TableSpec(prompt_column="title", keep_columns=("doc", "body"))
    with pytest.raises(JobConflict, match="different input or flags"):
        run(conn, tmp_path / "docs.parquet", tmp_path, table=other)


def test_kept_names_that_clash_with_result_columns():
    from batchgen.jobs.intake.kept import result_names

    assert result_names(["text", "doc", "id"]) == ["input_text", "doc", "input_id"]
    with pytest.raises(UsageError, match="column 'text' would come back as 'input_text'"):
        result_names(["text", "input_text"])


def test_template_syntax():
    template = parse("{{literal}} {a.b} and {c[0]}}}")
    assert template.columns == ["a.b", "c[0]"]
    assert template.render({"a.b": "{c[0]}", "c[0]": "x"}) == "{literal} {c[0]} and x}"
    # the template's own \n, \t, \\ (as a shell passes them); other backslashes stay
    escaped = parse(r"{a}\n{b}\t\\n \q")
    assert escaped.render({"a": "A\\n", "b": "B"}) == "A\\n\nB\t\\n \\q"
    for bad, message in (("{open", "not closed"), ("a } b", "single '}'"), ("{}", "empty {}"),
                         ("no columns", "names no column")):  # fmt: skip
        with pytest.raises(UsageError, match=message):
            parse(bad)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--template", "{title} {summary}"],
         "--template: no column 'summary' in the input (its columns: doc, title, body, "
         "max_tokens, temperature, seed)"),
        (["--prompt-column", "title", "--keep-columns", "doc,nope"],
         "--keep-columns: no column 'nope' in the input"),
        ([], "a table input needs exactly one of --prompt-column, --messages-column or "
             "--template"),
    ],
)  # fmt: skip
def test_cli_usage_errors_are_one_line_exit_2_nothing_queued(redis_url, tmp_path, flags, message):
    pq.write_table(docs(), tmp_path / "docs.parquet")
    result = cli("submit", str(tmp_path / "docs.parquet"), "--model", "m", "--output",
                 str(tmp_path / "o"), "--redis", redis_url, *flags)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert rconn(redis_url).dbsize() == 0


def test_cli_format_errors(redis_url, tmp_path):
    (tmp_path / "p.txt").write_text('{"prompt": "a"}\n')
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(docs(), mixed / "a.parquet")
    pacsv.write_csv(docs(), mixed / "b.csv")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    (tmp_path / "bad.csv").write_text("title,body\n1,2\n3\n")
    cases = [
        (tmp_path / "bad.parquet", ["--prompt-column", "title"], "cannot read the input as "
                                                                  "parquet: "),
        (tmp_path / "bad.csv", ["--prompt-column", "title"], "Expected 2 columns, got 1"),
        (mixed, ["--prompt-column", "title"], "must hold Parquet files or CSV files only, not "
                                              "csv and parquet"),
        (tmp_path / "p.jsonl", ["--prompt-column", "x"], "read a Parquet or CSV input"),
        (tmp_path / "p.txt", ["--prompt-column", "x"], "read a Parquet or CSV input"),  # JSONL
    ]  # fmt: skip
    for path, flags, message in cases:
        result = cli("submit", str(path), "--model", "m", "--output", str(tmp_path / "o"),
                     "--redis", redis_url, *flags)  # fmt: skip
        assert result.exit_code == 2, result.output
        assert message in result.output and result.output.count("\n") == 1
    assert rconn(redis_url).dbsize() == 0
    # any other name is JSONL lines, as submit always read it
    result = cli("submit", str(tmp_path / "p.txt"), "--model", "m", "--output",
                 str(tmp_path / "o"), "--redis", redis_url, "--job-id", "txt")  # fmt: skip
    assert (result.exit_code, result.stdout) == (0, "txt\n")


def test_help_names_the_table_flags():
    out = cli("submit", "--help").output
    for flag in ("--prompt-column", "--messages-column", "--template", "--id-column",
                 "--keep-columns", ".jsonl.zst", "Parquet"):  # fmt: skip
        assert flag in out


def test_parallel_validation_gives_the_same_entries_snapshot_and_errors(tmp_path):
    from batchgen.jobs.intake.kept import KEPT
    from batchgen.jobs.intake.sources import locate
    from batchgen.jobs.intake.tables import validate_table

    folder = tmp_path / "many"
    folder.mkdir()
    for f in range(3):  # row groups of 7 rows: ranges cut between and inside files
        rows = range(f * 30, f * 30 + 30)
        table = pa.table({"q": [f"q{i}" if i % 17 else "" for i in rows], "k": list(rows)})
        pq.write_table(table, folder / f"{f}.parquet", row_group_size=7)
    spec = TableSpec(prompt_column="q", keep_columns=("k",))
    out = []
    for procs in (1, 2, 5):
        spool = tmp_path / f"spool-{procs}"
        spool.mkdir()
        checked, names = validate_table(locate(str(folder)), spec, dict(DEFAULTS), spool,
                                        procs=procs)  # fmt: skip
        entries = b"".join(p.read_bytes() for p in checked.spools)
        kept = pq.read_table(spool / KEPT).column("k").to_pylist()
        out.append((checked.total, checked.error_count, [str(e) for e in checked.errors],
                    checked.sha256, entries, kept, names))  # fmt: skip
    assert out[0] == out[1] == out[2]
    total, error_count, errors, _, _, kept, _ = out[0]
    assert (total, error_count) == (90, 6)  # every row has an entry, the invalid ones too
    assert errors[:2] == ["row 0, column q: prompt is empty", "row 17, column q: prompt is empty"]
    assert kept == list(range(90))  # every row's, so row k of the snapshot is index k


def test_columns_named_like_sampling_fields_are_data_unless_mapped(redis_url, tmp_path):
    """A real data set with a count ``n`` and a ``seed`` column, kept whole: both are data;
    --sampling-columns maps a column to a field (its own name, or FIELD=COLUMN)."""
    table = pa.table({"q": ["a", "b"], "n": [40, 3], "seed": [7, 8], "budget": [3, 5]})
    pq.write_table(table, tmp_path / "counts.parquet")
    conn = rconn(redis_url)
    result = cli("submit", str(tmp_path / "counts.parquet"), "--model", "m", "--output",
                 str(tmp_path / "o1"), "--redis", redis_url, "--prompt-column", "q",
                 "--keep-columns", "all", "--job-id", "data")  # fmt: skip
    assert (result.exit_code, result.stdout) == (0, "data\n")
    assert [e["s"] for e in entries(conn, "data")] == [PROMPT, PROMPT]
    assert load_job(conn, KEYS, "data").kept_columns == ["q", "n", "seed", "budget"]
    result = cli("submit", str(tmp_path / "counts.parquet"), "--model", "m", "--output",
                 str(tmp_path / "o2"), "--redis", redis_url, "--prompt-column", "q",
                 "--sampling-columns", "seed, max_tokens=budget", "--job-id", "mapped")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [e["s"] for e in entries(conn, "mapped")] == [
        {**PROMPT, "seed": 7, "max_tokens": 3}, {**PROMPT, "seed": 8, "max_tokens": 5}]  # fmt: skip
    # mapped, n is checked as n: the count 40 is refused, by row and column
    result = cli("submit", str(tmp_path / "counts.parquet"), "--model", "m", "--output",
                 str(tmp_path / "o3"), "--redis", redis_url, "--prompt-column", "q",
                 "--sampling-columns", "n")  # fmt: skip
    assert result.exit_code == 2
    assert "row 0, column n: n must be an integer from 1 to 16" in result.output
    for flag, message in (("colour", "--sampling-columns: 'colour' is not a sampling field"),
                          ("seed=nope", "--sampling-columns: no column 'nope' in the input")):  # fmt: skip
        result = cli("submit", str(tmp_path / "counts.parquet"), "--model", "m", "--output",
                     str(tmp_path / "o4"), "--redis", redis_url, "--prompt-column", "q",
                     "--sampling-columns", flag)  # fmt: skip
        assert result.exit_code == 2 and message in result.output
        assert result.output.count("\n") == 1
    # a job recorded before the flag existed is read again (retry) as it was then
    legacy = TableSpec.from_json('{"prompt_column": "q", "keep_columns": []}')
    assert legacy.sampling_columns is None
    assert legacy.sampling_fields(["q", "n", "seed"]) == [("n", "n"), ("seed", "seed")]
    assert TableSpec.from_json(TableSpec(prompt_column="q").to_json()).sampling_columns == ()


def test_an_oversized_csv_cell_is_an_error_of_its_row_and_column(redis_url, tmp_path):
    """CSV rows up to 16 MiB are read (pyarrow's default block, 1 MiB, failed the whole
    submit on a 3 MB cell); a value over 8 MiB (a JSONL line's limit) is its row's error,
    skipped with --skip-invalid; a row too long to read stops the submit, naming the first
    row over 16 MiB and its longest column, also when it is the first row."""
    big, huge = "x" * (2 << 20), "y" * ((8 << 20) + 5)
    pacsv.write_csv(pa.table({"id": ["a", "b", "c", "d"], "q": ["short", big, huge, "end"]}),
                    tmp_path / "cells.csv")  # fmt: skip
    conn = rconn(redis_url)
    spec = TableSpec(prompt_column="q", id_column="id")
    with pytest.raises(InvalidInput) as info:
        run(conn, tmp_path / "cells.csv", tmp_path, job_id="c1", table=spec)
    assert str(info.value).endswith(
        "row 2, column q: the value is 8,388,613 bytes, over the limit of 8,388,608 bytes"
    )
    result = run(conn, tmp_path / "cells.csv", tmp_path, job_id="c2", table=spec,
                 skip_invalid=True)  # fmt: skip
    assert (result.total, result.skipped) == (4, 1)  # the oversized row: an error row in its place
    assert [(e.get("id"), len(e.get("p", "")), e.get("err")) for e in entries(conn, "c2")] == [
        ("a", 5, None), ("b", 2 << 20, None),
        (None, 0, "row 2, column q: the value is 8,388,613 bytes, over the limit of 8,388,608 bytes"),
        ("d", 3, None)]  # fmt: skip
    long = '"' + "z," * (20 << 20) + '"'  # 40 MiB, quoted, commas inside
    for name, text, row in (("later", f'id,note,q\nr0,"a, ""b"" c",ok\nr1,fine,{long}\n', 1),
                            ("first", f"id,note,q\nr0,fine,{long}\n", 0)):  # fmt: skip
        (tmp_path / f"{name}.csv").write_text(text)
        with pytest.raises(UsageError) as caught:
            run(conn, tmp_path / f"{name}.csv", tmp_path, job_id="c3",
                table=TableSpec(prompt_column="q"), skip_invalid=True)  # fmt: skip
        assert str(caught.value).startswith(f"row {row}, column q: the row is over "
                                            "16,777,216 bytes, the most a CSV row may hold")  # fmt: skip
    assert not conn.exists(KEYS.queue_for_model("m").job("c3").job)
