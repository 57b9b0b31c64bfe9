"""A split model's runners (tensor parallelism): a group leads, its ranks follow, each rank a process of its own.

    ort_group.py   TensorParallelRunner: the group of an ONNX Runtime split (rank 0 here, workers for the others)
    trt_group.py   TrtTensorParallelRunner: the group of a TensorRT split (a GPU a rank)
    trt_rank.py    TrtRankRunner: one TensorRT rank's runner, its engine given the group's NCCL communicator
    workers.py     the worker processes: started, served, stopped (the build's split quantization uses them too)

An ONNX Runtime rank is a plain PagedRunner whose graph's collectives meet the others' (runtime/kernels/collective).
"""
