"""Constrained decoding in the engine: valid output on every stopped row, parity.

Toy checkpoints have random weights, so their free text is never JSON: a row that
validates shows the constraint did the work.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from batchgen import Engine, SamplingParams, StructuredOutput
from batchgen.jobs.schema.errors import ParamError

SCHEMAS: dict[str, dict] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 10},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array with min/maxItems": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"enum": [1, 2, 3]},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
    "bounded numbers and booleans": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "adult": {"type": "boolean"},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["age", "adult", "score"],
        "additionalProperties": False,
    },
    "string pattern and maxLength": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "note": {"type": "string", "maxLength": 15},
        },
        "required": ["code", "note"],
        "additionalProperties": False,
    },
    "optional properties": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "string", "maxLength": 5},
            "c": {"type": "boolean"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "$defs and $ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
}
PER_SCHEMA = 8  # half greedy, half seeded sampling at temperature 1
PROMPTS = [f"Record {i}: describe item {i * 7 % 13} in JSON." for i in range(PER_SCHEMA)]


def _params(i: int, constraint: StructuredOutput | None, max_tokens: int = 160) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=100 + i,
                              structured_output=constraint)  # fmt: skip
    return SamplingParams(max_tokens=max_tokens, structured_output=constraint)


@pytest.fixture(scope="module")
def engine(toy_model) -> Engine:
    return Engine.from_pretrained(toy_model("llama"), num_kv_blocks=512, max_num_seqs=64)


@pytest.fixture(scope="module")
def schema_outputs(engine):
    """Every schema's rows, run in one mixed batch."""
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        for i, prompt in enumerate(PROMPTS):
            prompts.append(prompt)
            params.append(_params(i, StructuredOutput(json=schema)))
            names.append(name)
    outs = engine.generate(prompts, params)
    by_name: dict[str, list] = {name: [] for name in SCHEMAS}
    for name, out in zip(names, outs):
        by_name[name].append(out)
    return by_name


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_stopped_row_validates_against_its_schema(schema_outputs, name):
    outs = schema_outputs[name]
    stopped = [o for o in outs if o.finish_reason == "stop"]
    for out in stopped:
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
        assert out.text == json.dumps(json.loads(out.text), separators=(",", ":"),
                                      ensure_ascii=False)  # compact  # fmt: skip
    assert len(stopped) == len(outs), [(o.finish_reason, o.text) for o in outs]


def test_at_least_95_percent_of_all_rows_stop(schema_outputs):
    outs = [o for rows in schema_outputs.values() for o in rows]
    stopped = sum(o.finish_reason == "stop" for o in outs)
    assert stopped >= 0.95 * len(outs)


def test_without_the_constraint_no_row_is_json(engine):
    outs = engine.generate(PROMPTS, [_params(i, None, max_tokens=60) for i in range(PER_SCHEMA)])
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_one_schema_compiles_once_per_engine(toy_model):
    engine = Engine.from_pretrained(toy_model("llama"), num_kv_blocks=256)
    constraint = StructuredOutput(json=SCHEMAS["enums"])
    same_text = StructuredOutput(json=json.dumps(SCHEMAS["enums"], indent=2))  # same content
    engine.generate(PROMPTS, [_params(i, constraint) for i in range(4)]
                    + [_params(i, same_text) for i in range(4, 8)])  # fmt: skip
    assert engine.grammars.num_compiled == 1
    engine.generate(PROMPTS[:2], _params(0, StructuredOutput(regex="[ab]{3}")))
    assert engine.grammars.num_compiled == 2


def test_regex_choice_grammar_and_json_object(engine):
    choices = ['say "hi"', "back\\slash", "plain"]
    grammar = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[a-z]{2,8}/\n'
    cases = [
        (StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (StructuredOutput(choice=choices), lambda t: t in choices),
        (StructuredOutput(grammar=grammar), lambda t: re.fullmatch(r"(hello|hi) [a-z]{2,8}!", t)),
    ]  # fmt: skip
    prompts, params = [], []
    for constraint, _ in cases:
        for i, prompt in enumerate(PROMPTS):
            prompts.append(prompt)
            params.append(_params(i, constraint, max_tokens=200))
    outs = engine.generate(prompts, params)
    for k, (constraint, valid) in enumerate(cases):
        rows = outs[k * PER_SCHEMA : (k + 1) * PER_SCHEMA]
        assert [o.finish_reason for o in rows] == ["stop"] * PER_SCHEMA, constraint.kind
        for out in rows:
            assert valid(out.text), (constraint.kind, out.text)
    # seeded sampling over the choices picks more than one of them
    assert len({o.text for o in outs[PER_SCHEMA : 2 * PER_SCHEMA]}) > 1


def test_json_object_rows_that_stop_are_objects(engine):
    """Any object: a random model may wander in an unbounded string until max_tokens,
    so only the stopped rows are whole (OpenAI's json_object behaves the same)."""
    params = [_params(i, StructuredOutput(json_object=True), max_tokens=60) for i in range(8)]
    outs = engine.generate(PROMPTS, params)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(o.text), dict) for o in stopped)
    assert all(o.text.startswith("{") for o in outs)
    assert {o.finish_reason for o in outs} <= {"stop", "length"}


def test_max_tokens_cut_keeps_length(engine):
    constraint = StructuredOutput(json=SCHEMAS["nested objects"])
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=5, structured_output=constraint))[
        0
    ]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert '{"person":{'.startswith(out.text)  # a prefix of the only way to start


def test_parameters_that_would_cut_the_grammar_short_are_refused():
    constraint = StructuredOutput(choice=["a", "b"])
    for bad in ({"stop": ["x"]}, {"stop_token_ids": [5]}, {"min_tokens": 3}):
        with pytest.raises(ParamError, match="cannot be combined with structured_output"):
            SamplingParams(structured_output=constraint, **bad)
    with pytest.raises(ParamError, match="regex does not compile"):
        StructuredOutput(regex="a(b")
    with pytest.raises(ParamError, match="exactly one of"):
        StructuredOutput(regex="a", choice=["a"])
    # a queue entry's one-key form is taken as well
    entry_form: Any = {"choice": ["a", "b"]}
    assert SamplingParams(structured_output=entry_form).structured_output == constraint


# -- parity: the same tokens whatever ran beside them ---------------------------------

MIXED = [
    (SCHEMAS["nested objects"], 0),
    (SCHEMAS["$defs and $ref"], 1),
    (None, 2),
    (SCHEMAS["enums"], 3),
    (None, 4),
    (SCHEMAS["array with min/maxItems"], 5),
]


def _mixed_params() -> list[SamplingParams]:
    return [_params(i, StructuredOutput(json=s) if s else None, max_tokens=60) for s, i in MIXED]


def _mixed_prompts() -> list[str]:
    return [PROMPTS[i] * (1 + i % 3) for _, i in MIXED]  # different lengths, shared heads


@pytest.fixture(scope="module")
def alone(toy_model) -> list[list[int]]:
    """Each mixed request run by itself on a roomy engine."""
    engine = Engine.from_pretrained(toy_model("llama"), num_kv_blocks=512)
    return [
        engine.generate([prompt], p)[0].token_ids
        for prompt, p in zip(_mixed_prompts(), _mixed_params())
    ]


@pytest.mark.parametrize(
    "settings",
    [
        {"num_kv_blocks": 512},
        {"num_kv_blocks": 512, "enable_prefix_caching": False},
        {"num_kv_blocks": 14, "block_size": 16},  # too small for all at once: preemption
        {"num_kv_blocks": 512, "max_num_batched_tokens": 16},  # chunked prefill
    ],
    ids=["batched", "no-prefix-cache", "preempted", "chunked"],
)
def test_constrained_outputs_equal_alone_and_in_a_mixed_batch(toy_model, alone, settings):
    engine = Engine.from_pretrained(toy_model("llama"), max_num_seqs=8, **settings)
    # twice: the second round hits the prefix cache where it is on
    for _ in range(2):
        outs = engine.generate(_mixed_prompts(), _mixed_params())
        assert [o.token_ids for o in outs] == alone
    if settings["num_kv_blocks"] == 14:
        assert engine.stats().num_preemptions > 0


def test_hand_back_resumed_by_another_engine_continues_exactly(toy_model, alone):
    prompts, params = _mixed_prompts(), _mixed_params()
    first = Engine.from_pretrained(toy_model("llama"), num_kv_blocks=512)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        first.add_request(f"r{i}", prompt, p)
    for _ in range(12):
        first.step()
    handed_back = {o.request_id: o for o in first.drain()}
    constrained = [i for i, (schema, _) in enumerate(MIXED) if schema]
    # constrained requests were cut midway: their matchers must be rebuilt from the tokens
    assert sum(0 < len(handed_back[f"r{i}"].token_ids) < len(alone[i]) for i in constrained) >= 2
    second = Engine.from_pretrained(toy_model("llama"), num_kv_blocks=512)  # "another worker"
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        partial = handed_back[f"r{i}"].token_ids
        assert partial == alone[i][: len(partial)]
        second.add_request(f"r{i}", prompt, p, resume_token_ids=partial)
    done = {}
    while second.has_unfinished():
        done.update({o.request_id: o for o in second.step()})
    assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == alone


def test_n_samples_each_follow_the_constraint(engine):
    constraint = StructuredOutput(json=SCHEMAS["enums"])
    params = SamplingParams(
        max_tokens=80, temperature=1.0, seed=9, n=3, structured_output=constraint
    )
    out = engine.generate([PROMPTS[0]], params)[0]
    assert len(out.samples) == 3
    for sample in out.samples:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), SCHEMAS["enums"])


def test_the_docs_grammar_example_generates_what_it_says(engine):
    from tests.doc_blocks import doc_block

    grammar = doc_block("structured-grammar").text
    params = [_params(i, StructuredOutput(grammar=grammar), max_tokens=120) for i in range(4)]
    for out in engine.generate(PROMPTS[:4], params):
        assert out.finish_reason == "stop"
        assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", out.text), out.text
