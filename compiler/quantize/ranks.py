"""Quantize a split model (`parallel.tensor`): every rank's graph at once, each rank in a process of its own.

A rank's graph cannot run alone: its llmc.AllReduce / AllGather nodes meet the other ranks'. The weight-only modes
run the graph they quantize (AWQ's calibration pass, the quality report's perplexity, agreement and speed), so
the ranks quantize together: one worker process per rank (runtime/runners/parallel/workers.py), each running the same
`quantize()` a whole model runs, on its rank's graph, with the group's name in its environment
(collective.GROUP_ENV), so every session it opens sums with the other ranks'. The runs are the same on every rank
(the same windows, prompts and steps, in the same order; the sampled tokens come from the gathered logits, equal
on every rank), so the collectives pair up. This process supervises: it relays rank 0's progress, and the first
rank to fail (an error, or a process that died) aborts the group, so the others return from their collectives
at once, and the build fails naming that rank.

What a rank decides from its own weights stays its own, and the function stays the same: AWQ's scale for the
inputs of q/k/v is searched on the rank's columns and folded into the rank's own copy of the norm before them;
a row-parallel layer's blocks run along the rank's input channels, so when those are a multiple of the block
(Qwen2.5-0.5B's 4,864 MLP channels over 2 ranks: 76 blocks of 32 each) the blocks fall on the rank boundaries, and
otherwise each rank pads its last block as MatMulNBits does.

A build that read the checkpoint a layer at a time (`source.load: layers`) quantizes its ranks the same way: each
rank's sessions are over its whole graph, so the ranks together hold the whole model's weights on this host
(compiler/pipeline/plan.py counts every rank's process).

The result: `rank{r}/` holds rank r's quantized graph and its own record; the stage's record lists every rank's
files, and its quality report is rank 0's (every rank computes the same logits) with the sizes summed over the
ranks.
"""

from __future__ import annotations

import multiprocessing.connection
import os
from pathlib import Path
from typing import Callable

from llmc.compiler.artifacts import ExportedModel, QuantizedModel
from llmc.compiler.graph.files import EXTERNAL_THRESHOLD
from llmc.compiler.source import SourceInfo
from llmc.compiler.spec import QuantizationSpec
from llmc.errors import QuantizationError
from llmc.runtime.manifest import rank_folder

RANK_WAIT_S = 3600  # a rank's wait for the others in a collective; the supervisor aborts sooner when one fails


def rank_export(exported: ExportedModel, rank: int) -> ExportedModel:
    """Rank `rank`'s graph as a whole model's export record, relative to its own folder."""
    prefix = rank_folder(rank, exported.tensor_parallel) + "/"
    files = {name[len(prefix):]: digest for name, digest in exported.files.items() if name.startswith(prefix)}
    return exported.model_copy(update={"files": files, "tensor_parallel": 1})


def quantize_split(exported: ExportedModel, export_dir: Path, out_dir: Path, spec: QuantizationSpec,
                   source: SourceInfo, *, inputs_hash: str, num_threads: int = 0,
                   external_threshold: int = EXTERNAL_THRESHOLD,
                   previous: Path | None = None, progress: Callable[[int, int], None] | None = None
                   ) -> QuantizedModel:
    """Quantize each rank's graph of the split export in `export_dir` into `out_dir/rank{r}`, the ranks together;
    `num_threads` is shared out among them (0: the cores)."""
    from llmc.runtime.kernels.collective import GROUP_ENV, TIMEOUT_ENV, Group
    from llmc.runtime.runners.parallel.workers import start_worker

    ranks = exported.tensor_parallel
    threads = max(1, (num_threads or os.cpu_count() or 1) // ranks)
    folders = [rank_folder(r, ranks) for r in range(ranks)]
    with Group.create(ranks) as group:
        workers = []
        try:
            for rank, folder in enumerate(folders):
                earlier = previous / folder if previous is not None and (previous / folder).is_dir() else None
                job = dict(rank=rank, exported=rank_export(exported, rank), export_dir=export_dir / folder,
                           out_dir=out_dir / folder, spec=spec, source=source, inputs_hash=inputs_hash,
                           num_threads=threads, external_threshold=external_threshold, previous=earlier)
                workers.append(start_worker(__name__, "rank_main", job, cwd=export_dir / folder,
                                            env={GROUP_ENV: group.name, TIMEOUT_ENV: str(RANK_WAIT_S)}))
            _supervise(workers, group, progress)
        finally:
            for process, conn in workers:
                if process.poll() is None:
                    process.kill()
                process.wait()
                conn.close()
    return _combined([QuantizedModel.load(out_dir / folder) for folder in folders], folders, inputs_hash)


def _supervise(workers: list, group, progress: Callable[[int, int], None] | None) -> None:
    """Wait until every rank is done; the first failure aborts the group and is raised, naming the rank."""
    pending = dict(enumerate(workers))
    failure = None
    while pending:
        by_conn = {conn: rank for rank, (_, conn) in pending.items()}
        for conn in multiprocessing.connection.wait(list(by_conn)):
            rank = by_conn[conn]
            try:
                kind, *detail = conn.recv()
            except (EOFError, OSError):  # its end closed without a word: the process died
                process = pending[rank][0]
                kind, detail = "error", [f"rank {rank} (pid {process.pid}) exited with code {process.wait()} while "
                                         "quantizing its graph"]
            if kind == "progress":
                if progress:
                    progress(*detail)
                continue
            del pending[rank]
            if kind == "error":
                group.abort(detail[0])  # the first abort's reason stays: the cause, not its echoes
                failure = failure or group.aborted_reason()
    if failure:
        raise QuantizationError(f"quantizing the split model (parallel.tensor: {len(workers)}): {failure}")


def _combined(parts: list[QuantizedModel], folders: list[str], inputs_hash: str) -> QuantizedModel:
    """One record for the stage: every rank's files under its folder; rank 0's report, with the sizes summed."""
    first = parts[0]
    report = first.report.model_copy(update={"size_reference_mib": sum(p.report.size_reference_mib for p in parts),
                                             "size_quantized_mib": sum(p.report.size_quantized_mib for p in parts)})
    files = {f"{folder}/{name}": digest for folder, part in zip(folders, parts) for name, digest in part.files.items()}
    return first.model_copy(update={"inputs_hash": inputs_hash, "files": files, "report": report})


def rank_main(conn: multiprocessing.connection.Connection) -> None:
    """A rank's worker: quantize its graph as a whole model's (`quantize()`), then say done or why not."""
    from llmc.compiler.quantize import quantize
    from llmc.compiler.source import load_tokenizer
    from llmc.runtime.kernels.collective import GROUP_ENV, Group
    from llmc.runtime.runners.parallel.workers import die_with_parent

    die_with_parent()
    job = conn.recv()
    rank = job["rank"]
    try:
        report = (lambda done, total, what="": conn.send(("progress", done, total, what))) if rank == 0 else None
        quantize(job["exported"], job["export_dir"], job["out_dir"], job["spec"], load_tokenizer(job["source"]),
                 inputs_hash=job["inputs_hash"], num_threads=job["num_threads"],
                 external_threshold=job["external_threshold"], previous=job["previous"], progress=report)
    except BaseException as err:  # noqa: BLE001 (everything goes back to the supervisor)
        reason = f"rank {rank} failed: {type(err).__name__}: {err}"
        Group.attach(os.environ[GROUP_ENV]).abort(reason)
        conn.send(("error", reason))
        return
    conn.send(("done",))
