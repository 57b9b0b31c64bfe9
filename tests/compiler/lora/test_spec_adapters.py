"""The spec's `adapters:` mapping and `lora:` limits (compiler/spec/adapters.py): defaults, folders resolved
against the spec file like its other paths, and errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import write_spec


def test_defaults_and_paths_relative_to_the_spec(tmp_path):
    from llmc.compiler.spec import load_spec, parse_spec

    plain = parse_spec({"name": "m", "source": "ckpt"})
    assert plain.adapters == {} and (plain.lora.max_slots, plain.lora.max_rank, plain.lora.max_host_adapters) == \
        (4, 64, 32)
    spec = load_spec(write_spec(tmp_path / "specs", {"name": "m", "source": "../ckpt",
                                                      "adapters": {"fr": "../adapters/fr", "sql.v2": "/abs/sql"},
                                                      "lora": {"max_rank": 16, "max_slots": 2}}))
    assert spec.adapters == {"fr": (tmp_path / "adapters" / "fr").resolve(), "sql.v2": Path("/abs/sql")}
    assert (spec.lora.max_slots, spec.lora.max_rank, spec.lora.max_host_adapters) == (2, 16, 32)
    assert spec.section_hash("adapters", "lora") != plain.section_hash("adapters", "lora")


@pytest.mark.parametrize("fields, message", [
    ({"adapters": {"m": "x"}}, "adapters: 'm': an adapter cannot take the model's own name"),
    ({"adapters": {"-fr": "x"}}, "adapters: '-fr': an adapter name is 1-64 letters"),
    ({"adapters": ["fr"]}, "adapters: Input should be a valid dictionary"),
    ({"lora": {"max_rank": 0}}, "lora.max_rank: Input should be greater than or equal to 1"),
    ({"lora": {"max_slots": 65}}, "lora.max_slots: Input should be less than or equal to 64"),
    ({"lora": {"max_slots": 8, "max_host_adapters": 4}}, "lora: max_host_adapters (4) must be >= max_slots (8)"),
    ({"lora": {"slots": 2}}, "lora.slots: unknown field"),
])
def test_errors_name_the_field(fields, message):
    from llmc.compiler.spec import parse_spec
    from llmc.errors import SpecError

    with pytest.raises(SpecError) as err:
        parse_spec({"name": "m", "source": "ckpt", **fields})
    assert message in str(err.value)


def test_a_build_with_an_unreadable_adapter_is_refused_before_any_stage_works(tmp_path, tiny_checkpoints):
    """The package stage's check reads every adapter right after the source stage (compiler/lora/package.py): a
    folder without PEFT's files fails the build before the export runs."""
    from llmc.compiler.lora import AdapterError
    from llmc.compiler.pipeline.run import build
    from llmc.compiler.spec import parse_spec

    adapter = tmp_path / "fr"
    adapter.mkdir()
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "adapters": {"fr": str(adapter)}})
    with pytest.raises(AdapterError, match="adapter 'fr': .*adapter_config.json is missing"):
        build(spec, output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, tied", [("gpt2", True), ("llama", False)])
def test_the_build_check_reads_the_head_from_the_config_alone(family, tied, tmp_path, tiny_checkpoints):
    """The package stage's check builds the base on the meta device, where transformers does not tie the head to the
    embeddings: a tied head is known by the config (an adapter on it refused, no head site, no head tensor read), an
    untied one is a site whose weight digest comes from the checkpoint's tensor."""
    from peft_adapters import make_adapter

    from llmc.compiler.lora import AdapterError
    from llmc.compiler.lora.adapter import weight_digest
    from llmc.compiler.lora.package import checked_adapters, meta_model
    from llmc.compiler.lora.sites import module_members
    from llmc.compiler.source import inspect_source
    from llmc.compiler.spec import parse_spec

    checkpoint = tiny_checkpoints[family]
    targets = ["c_attn", "lm_head"] if family == "gpt2" else ["q_proj", "lm_head"]
    folder = make_adapter(checkpoint, tmp_path / "h", r=2, lora_alpha=4, target_modules=targets,
                          **({"fan_in_fan_out": True} if family == "gpt2" else {}))
    spec = parse_spec({"name": "t", "source": str(checkpoint), "adapters": {"h": str(folder)}})
    source, meta = inspect_source(spec.source), meta_model(inspect_source(spec.source))
    assert ("lm_head" in module_members(meta)) == (not tied)
    if tied:
        with pytest.raises(AdapterError, match="lm_head, the LM head, which this model ties"):
            checked_adapters(spec, source, meta)
    else:
        from transformers import AutoModelForCausalLM

        adapters, digest = checked_adapters(spec, source, meta)
        assert digest == weight_digest(AutoModelForCausalLM.from_pretrained(checkpoint).lm_head.weight)
        assert adapters[0].copies == {"lm_head": digest}
