"""`inspect`: what a build folder, a stage folder or an .onnx file holds, as titled rows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from llmc.compiler.artifacts import AdapterVerifyReport, ExportedModel, QuantizedModel, TensorInfo, VerifyReport
from llmc.errors import ArtifactError


@dataclass
class Section:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)


def _shape(t: TensorInfo) -> str:
    return f"{t.dtype}[{', '.join(str(d) for d in t.shape)}]"


def _io_rows(tensors: list[TensorInfo], kv_prefixes: tuple[str, ...]) -> list[tuple[str, str]]:
    """All non-KV tensors, then the KV tensors folded to one row per name pattern."""
    rows = [(t.name, _shape(t)) for t in tensors if not t.name.startswith(kv_prefixes)]
    kv = [t for t in tensors if t.name.startswith(kv_prefixes)]
    if kv:
        rows.append((f"{kv[0].name} .. {kv[-1].name}", f"{len(kv)} tensors, {_shape(kv[0])}"))
    return rows


def exported_sections(art: ExportedModel, folder: Path) -> list[Section]:
    m, kv = art.model, art.kv_layout
    summary = Section("export", [
        ("onnx", str(folder / art.onnx)), ("opset", str(art.opset)),
        ("model", f"{m.model_type} ({m.family} family), {m.num_layers} layers, {m.num_heads} heads, "
                  f"{m.num_kv_heads} KV heads, head dim {m.head_dim}, vocab {m.vocab_size}"),
        ("attention", f"{art.lowering.value} lowering of llmc::attention"),
        ("kv layout", f"[{', '.join(kv.dims)}] {kv.dtype}, {kv.past_key} -> {kv.present_key}, positions from "
                      f"{kv.positions}, {'updated in place' if kv.in_place else 'copied each step'}"
                      + (f", prefill {kv.max_prefill_rows} row(s) per step" if kv.max_prefill_rows else "")
                      + (f", paged: blocks of {kv.block_size} tokens, packed tokens, block tables" if kv.paged else "")),
        ("external data", "yes" if art.external_data else "no"),
        ("source hash", art.source_hash), ("inputs hash", art.inputs_hash),
        *[(f"sha256 {name}", h) for name, h in art.files.items()],
        ("versions", ", ".join(f"{k} {v}" for k, v in art.versions.items())),
    ])
    return [summary, Section("inputs", _io_rows(art.inputs, ("past_key_values.",))),
            Section("outputs", _io_rows(art.outputs, ("present.",)))]


def verify_sections(report: VerifyReport, title: str = "verify") -> list[Section]:
    rows = [("result", "passed" if report.passed else "FAILED"), ("reference", report.reference),
            ("candidate", report.candidate), ("max |Δlogit|", f"{report.max_abs_logit_diff:.3e} (tolerance {report.tolerance:.0e})")]
    for c in report.cases:
        rows.append((c.name, f"prompts {c.prompt_lengths} tokens, {c.decode_steps} steps, "
                             f"{c.token_agreement:.1%} greedy tokens equal, max |Δlogit| {c.max_abs_logit_diff:.2e}"))
    if isinstance(report, AdapterVerifyReport):
        rows += [(f"adapter {name}", f"digest {digest}") for name, digest in report.adapters.items()]
    return [Section(title, rows)]


def quantized_sections(art: QuantizedModel, folder: Path) -> list[Section]:
    r = art.report
    return [Section("quantization", [
        ("mode", art.mode.value), ("method", art.method), ("calibration", art.calibration),
        ("onnx", str(folder / art.onnx)),
        ("perplexity", f"{r.perplexity_reference:.3f} -> {r.perplexity_quantized:.3f} ({r.perplexity_increase:+.2%}) "
                       f"on {r.eval_tokens} tokens of {r.eval_text}"),
        ("greedy agreement", f"{r.token_agreement:.1%} of {r.agreement_tokens} tokens (teacher-forced, verify prompts)"),
        ("size", f"{r.size_reference_mib:.1f} -> {r.size_quantized_mib:.1f} MiB "
                 f"({r.size_quantized_mib / r.size_reference_mib:.0%})"),
        ("decode, batch 1", f"{r.decode_tok_s_reference:.1f} -> {r.decode_tok_s_quantized:.1f} tok/s "
                            f"({r.decode_speedup()}, {r.runtime})" if r.decode_tok_s_reference else
                            f"{r.decode_speedup()}, {r.runtime}"),
        ("inputs hash", art.inputs_hash),
    ])]


def onnx_sections(path: Path) -> list[Section]:
    import onnx

    from llmc.compiler.artifacts import tensor_infos

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:
        raise ArtifactError(f"{path}: not a readable ONNX model ({err})") from None
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import)
    ops: dict[str, int] = {}
    for node in proto.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    top = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))
    return [Section("onnx", [("file", str(path)), ("opsets", opsets), ("nodes", f"{len(proto.graph.node)}: {top}")]),
            Section("inputs", _io_rows(tensor_infos(proto.graph.input), ("past_key_values.",))),
            Section("outputs", _io_rows(tensor_infos(proto.graph.output), ("present.",)))]


def inspect_path(path: Path) -> list[Section]:
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        return onnx_sections(path)
    if not path.is_dir():
        raise ArtifactError(f"{path}: not a build folder, a stage folder or an .onnx file")
    sections: list[Section] = []
    record = path / "build.json"
    if record.is_file():
        data = json.loads(record.read_text())
        sections.append(Section("build", [("name", data["name"]), ("built at", data["built_at"]),
                                          ("llmc", data["llmc"])] +
                                [(f"stage {s['name']}", f"{s['status']} in {s['seconds']:.1f}s: {s['summary']}")
                                 for s in data["stages"]]))
    for folder in (path, path / "export"):
        if (folder / ExportedModel.filename).is_file():
            sections += exported_sections(ExportedModel.load(folder), folder)
    for folder in (path, path / "verify"):
        if (folder / VerifyReport.filename).is_file():
            sections += verify_sections(VerifyReport.load(folder))
    for folder in (path, path / "verify-adapters"):
        if (folder / AdapterVerifyReport.filename).is_file():
            sections += verify_sections(AdapterVerifyReport.load(folder), "verify-adapters")
    for folder in (path, path / "quantize"):
        if (folder / QuantizedModel.filename).is_file():
            sections += quantized_sections(QuantizedModel.load(folder), folder)
    if not sections:
        raise ArtifactError(f"{path}: holds no llmc artifact (build.json, exported.json, verify.json, "
                            f"adapters_verify.json or quantized.json)")
    return sections
