"""Random JSON schemas (drawn by hypothesis) through llguidance's masks with random logits: every output
that finishes validates against its schema with `jsonschema`. hypothesis-jsonschema draws instances,
not schemas, and breaks with the hypothesis installed here (DESIGN.md), so the schemas are composed
from hypothesis' own strategies: objects, arrays, anyOf, enums, bounded strings and numbers, nested."""

import json

import jsonschema
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import byte_tokenizer
from llmc.runtime.decoding.grammar import Guide, GuideCompiler, next_token_bitmask
from llmc.runtime.decoding.sampling import SamplingParams, sample_rows

END = 0
_COMPILER = None

names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
scalars = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]$"])),
    st.lists(st.one_of(st.text("xyz", max_size=3), st.integers(-9, 9), st.booleans()), min_size=1, max_size=4,
             unique_by=lambda v: (type(v), v)).map(lambda values: {"enum": values}),
)


def _object(children):
    def make(props, required, closed):
        schema = {"type": "object", "properties": props, "required": [k for k in props if k in required]}
        if closed:
            schema["additionalProperties"] = False
        return schema
    return st.builds(make, st.dictionaries(names, children, min_size=1, max_size=3),
                     st.sets(names, max_size=3), st.booleans())


schemas = st.recursive(scalars, lambda children: st.one_of(
    _object(children),
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
), max_leaves=8)


def _compiler():
    global _COMPILER
    if _COMPILER is None:
        _COMPILER = GuideCompiler(byte_tokenizer(), [END], 256)
    return _COMPILER


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**32 - 1))
def test_every_finished_output_validates_against_its_random_schema(schema, seed):
    matcher = _compiler().compile(Guide("json_schema", json.dumps(schema)))
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=1.0, end_ids=(END,), max_tokens=400)
    out: list[int] = []
    for _ in range(params.max_tokens):
        bitmask = next_token_bitmask([matcher], [params.end_ids], [END], 256)
        logits = rng.normal(0, 2, (1, 256)).astype(np.float32)
        token = int(sample_rows(logits, [params], [[1]], [out], [rng], ([0], bitmask))[0])
        if token == END:
            break
        out.append(token)
        matcher.consume(token)
        if matcher.is_stopped:
            break
    else:
        return  # cut by max_tokens: not a finished output
    jsonschema.validate(json.loads(byte_tokenizer().decode(out)), schema)
