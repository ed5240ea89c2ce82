"""Quantized checkpoints: INT4 group-wise (compressed-tensors ``pack-quantized``) and FP8 e4m3 with block scales.

``config``: parse ``quantization_config``; ``layout``: which layers are quantized and whether a layout's
shards cut a group or block; ``linear``/``experts``: the layers that hold packed weights and scales and load
them shard by shard; ``reference``: the torch kernels (dequantize, then matmul) every faster kernel is
checked against.
"""
