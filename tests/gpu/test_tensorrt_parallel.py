"""Two ranks' TensorRT engines meeting in NCCL, where TensorRT (10.16+), two GPUs and NCCL exist (skipped here with
the reason): each rank's graph (a matmul by its own weight shard, then llmc's all-reduce and all-gather) is
rewritten to DistCollective nodes (plugins/trt/collective_node.py), built by the engine loaders with the collectives
checked (compiler/tensorrt/collectives.py), and run by one process per GPU whose execution context holds the rank's
NCCL communicator (runtime/runners/parallel/trt_rank.py); both ranks must get the sum of the shards' products and their
products side by side in rank order."""

import multiprocessing

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from multi_gpu import marks

WORLD, ROWS, HIDDEN, OUT = 2, 4, 8, 6


pytestmark = marks(WORLD)


def _weights(rank):
    return np.random.default_rng(rank).standard_normal((HIDDEN, OUT)).astype(np.float32)


def _rank_onnx(rank, path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, HIDDEN])
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, [ROWS, OUT])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("AllReduce", ["h"], ["summed"], domain="llmc", rank=rank, world_size=WORLD),
             helper.make_node("AllGather", ["h"], ["gathered"], domain="llmc", rank=rank, world_size=WORLD)]
    graph = helper.make_graph(nodes, "rank", [x], [
        helper.make_tensor_value_info("summed", TensorProto.FLOAT, [ROWS, OUT]),
        helper.make_tensor_value_info("gathered", TensorProto.FLOAT, [ROWS, OUT * WORLD])],
        initializer=[numpy_helper.from_array(_weights(rank), "w")], value_info=[h])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llmc", 1)])
    from llmc.plugins.trt.collective_node import to_dist_collectives

    assert to_dist_collectives(model) == (rank, WORLD, 1, 1)
    onnx.save(model, str(path))


def _build(rank, tmp_path):
    from llmc.compiler.spec import TensorRTSpec
    from llmc.compiler.tensorrt.collectives import expected_collectives
    from llmc.compiler.tensorrt.engine import create_config, engine_from_network, network_from_onnx
    from llmc.compiler.tensorrt.profiles import Profile

    path = tmp_path / f"rank{rank}.onnx"
    _rank_onnx(rank, path)
    profile = Profile("fixed", {"x": ((ROWS, HIDDEN),) * 3})
    engine = engine_from_network(network_from_onnx(path, expected_collectives(path)),
                                 create_config(TensorRTSpec(), [profile], multi_device=True))()
    (tmp_path / f"rank{rank}.plan").write_bytes(memoryview(engine.serialized))
    return tmp_path / f"rank{rank}.plan"


def _rank_main(rank, plan, unique_id, x, results):
    import tensorrt as trt

    from llmc.runtime.runners.trt import _cuda, _ok
    from llmc.runtime.runners.parallel.trt_rank import Nccl, communicator_capsule

    cudart = _cuda()
    _ok(cudart.cudaSetDevice(rank))
    nccl = Nccl()
    comm = nccl.init_rank(WORLD, unique_id, rank)
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan.read_bytes())
    context = engine.create_execution_context()
    assert context.set_communicator(communicator_capsule(comm))
    stream = _ok(cudart.cudaStreamCreate())
    host = {"x": np.ascontiguousarray(x), "summed": np.empty((ROWS, OUT), np.float32),
            "gathered": np.empty((ROWS, OUT * WORLD), np.float32)}
    device = {name: _ok(cudart.cudaMalloc(a.nbytes)) for name, a in host.items()}
    _ok(cudart.cudaMemcpy(device["x"], host["x"].ctypes.data, host["x"].nbytes,
                          cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))
    for name, ptr in device.items():
        context.set_tensor_address(name, ptr)
    assert context.execute_async_v3(stream)
    _ok(cudart.cudaStreamSynchronize(stream))
    for name in ("summed", "gathered"):
        _ok(cudart.cudaMemcpy(host[name].ctypes.data, device[name], host[name].nbytes,
                              cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    results.put((rank, host["summed"], host["gathered"]))
    del context, engine
    nccl.destroy(comm)


def test_two_rank_engines_reduce_and_gather_through_nccl(tmp_path):
    from llmc.runtime.runners.parallel.trt_rank import Nccl

    plans = [_build(rank, tmp_path) for rank in range(WORLD)]
    x = np.random.default_rng(7).standard_normal((ROWS, HIDDEN)).astype(np.float32)
    spawn = multiprocessing.get_context("spawn")
    results, unique_id = spawn.Queue(), Nccl().unique_id()
    ranks = [spawn.Process(target=_rank_main, args=(r, plans[r], unique_id, x, results)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    got = dict((r, (s, g)) for r, s, g in (results.get(timeout=300) for _ in ranks))
    for p in ranks:
        p.join(timeout=60)
        assert p.exitcode == 0
    products = [x @ _weights(r) for r in range(WORLD)]
    for rank in range(WORLD):
        summed, gathered = got[rank]
        np.testing.assert_allclose(summed, sum(products), rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(gathered, np.concatenate(products, axis=-1), rtol=1e-3, atol=1e-3)
