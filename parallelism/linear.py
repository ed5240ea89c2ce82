"""Parallel layers that own their shard and their collective.

Each layer lists the checkpoint tensors it needs with :meth:`checkpoint_tensors` (name suffix, full
shape, loader); the loader narrows the *full* checkpoint tensor to this rank's shard through a lazy
:class:`TensorSource`, so one checkpoint loads under every layout and each rank reads only its slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from parallelism.comm import Comm
from parallelism.layout import divide


class TensorSource(Protocol):
    """A checkpoint tensor that can be read in slices (a safetensors slice, or an in-memory tensor)."""

    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def read(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor a layer needs: checkpoint-name suffix, expected full shape, and how to load it;
    ``quantized``: stored in a quantized dtype (int32-packed, fp8) on purpose."""

    suffix: str
    full_shape: tuple[int, ...]
    load: Callable[[TensorSource], None]
    quantized: bool = False


def copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def narrow_rows(src: TensorSource, dim: int, shard: int, size: int, total: int) -> torch.Tensor:
    """Rows ``[shard*size, (shard+1)*size)`` of ``dim``, zero-padded where they run past ``total``."""
    start = shard * size
    length = max(0, min(size, total - start))
    part = src.narrow(dim, start, length) if length else None
    if length == size:
        return part
    shape = list(src.shape)
    shape[dim] = size
    out = torch.zeros(shape, dtype=part.dtype if part is not None else torch.float32)
    if part is not None:
        out.narrow(dim, 0, length).copy_(part)
    return out


class ShardedModule(nn.Module):
    """Base: a module whose parameters are filled from the checkpoint via ``checkpoint_tensors``. ``matmul`` is the
    ``F.linear``-compatible function its projections call (the model's kernel set sets it: ``CausalLM.use_kernels``)."""

    matmul: Callable = staticmethod(F.linear)

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        raise NotImplementedError


class ReplicatedLinear(ShardedModule):
    """``y = x W^T (+ b)`` with the full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.matmul(x, self.weight, self.bias)

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        yield CheckpointTensor("weight", tuple(self.weight.shape), lambda s: copy_into(self.weight, s.read()))
        if self.bias is not None:
            yield CheckpointTensor("bias", tuple(self.bias.shape), lambda s: copy_into(self.bias, s.read()))


class ColumnParallelLinear(ShardedModule):
    """Output dim split in ``num_shards`` contiguous blocks; this rank holds block ``shard``.

    No collective: the output stays sharded (``[T, out/num_shards]``). ``shard``/``num_shards``
    default to the group's rank/size; GQA passes KV-head shards explicitly to replicate KV heads.
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = False,
                 shard: int | None = None, num_shards: int | None = None, dtype=torch.float32):
        super().__init__()
        self.shard = comm.rank if shard is None else shard
        self.num_shards = comm.size if num_shards is None else num_shards
        self.full_out = out_features
        self.out_per_shard = divide(out_features, self.num_shards, "column-parallel output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_shard, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_per_shard, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out/num_shards]
        return self.matmul(x, self.weight, self.bias)

    def _rows(self, src: TensorSource) -> torch.Tensor:
        return src.narrow(0, self.shard * self.out_per_shard, self.out_per_shard)

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        shape = (self.full_out, self.weight.shape[1])
        yield CheckpointTensor("weight", shape, lambda s: copy_into(self.weight, self._rows(s)))
        if self.bias is not None:
            yield CheckpointTensor("bias", (self.full_out,), lambda s: copy_into(self.bias, self._rows(s)))


class MergedColumnParallelLinear(ShardedModule):
    """Several column-parallel projections of one input in one GEMM (e.g. gate and up).

    Checkpoint tensors ``names[i]`` (each ``[outs[i], in]``) are sharded alike and stacked along the
    output dim: ``y = [x W_0^T | x W_1^T | ...]`` with each part ``[T, outs[i]/size]``.
    """

    names_relative_to_parent = True  # "gate_proj.weight" lives beside this module, not under it

    def __init__(self, in_features: int, outs: list[int], names: list[str], comm: Comm, dtype=torch.float32):
        super().__init__()
        self.names = names
        self.full_outs = outs
        self.shard, self.num_shards = comm.rank, comm.size
        self.local_outs = [divide(o, comm.size, f"{n} output features") for o, n in zip(outs, names, strict=True)]
        self.weight = nn.Parameter(torch.empty(sum(self.local_outs), in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(outs)/size]
        return self.matmul(x, self.weight)

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        offset = 0
        for name, full, local in zip(self.names, self.full_outs, self.local_outs, strict=True):
            def load(s: TensorSource, offset=offset, local=local) -> None:
                copy_into(self.weight[offset:offset + local], s.narrow(0, self.shard * local, local))
            yield CheckpointTensor(f"{name}.weight", (full, self.weight.shape[1]), load)
            offset += local


class RowParallelLinear(ShardedModule):
    """Input dim split over the group; ``reduce=True`` sums the partial outputs with one all-reduce.

    With ``reduce=False`` the caller owns the reduction (to fuse several partial sums into one).
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, reduce: bool = True, dtype=torch.float32):
        super().__init__()
        self.comm = comm
        self.reduce = reduce
        self.in_per_shard = divide(in_features, comm.size, "row-parallel input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_shard, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/size] -> [T, out]
        y = self.matmul(x, self.weight)
        return self.comm.all_reduce(y) if self.reduce else y

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        shape = (self.weight.shape[0], self.in_per_shard * self.comm.size)
        yield CheckpointTensor("weight", shape, lambda s: copy_into(
            self.weight, s.narrow(1, self.comm.rank * self.in_per_shard, self.in_per_shard)))


class VocabParallelEmbedding(ShardedModule):
    """Embedding rows split over the group; any vocab size (the last shard is zero-padded).

    Ids outside this rank's rows contribute zeros; one all-reduce assembles the embeddings.
    """

    def __init__(self, vocab_size: int, hidden: int, comm: Comm, dtype=torch.float32):
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.rows_per_shard = -(-vocab_size // comm.size)
        self.start = comm.rank * self.rows_per_shard
        self.weight = nn.Parameter(torch.empty(self.rows_per_shard, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows_per_shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)

    def load_rows(self, src: TensorSource) -> None:
        copy_into(self.weight, narrow_rows(src, 0, self.comm.rank, self.rows_per_shard, self.vocab_size))

    def checkpoint_tensors(self) -> Iterator[CheckpointTensor]:
        yield CheckpointTensor("weight", (self.vocab_size, self.weight.shape[1]), self.load_rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection. Logits are gathered to group rank 0 only (where sampling runs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # [T, hidden] -> [T, vocab] on rank 0, else None
        local = self.matmul(x, self.weight)  # [T, V/size]
        if self.comm.size == 1:
            return local[:, : self.vocab_size]
        gathered = self.comm.gather(local.t().contiguous())  # [V_padded, T] on rank 0
        if gathered is None:
            return None
        return gathered[: self.vocab_size].t()

    def forward_all(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden]`` → ``[T, vocab]`` on every rank; ``weight``: a copy of this shard to use instead
        (e.g. in another dtype, matching ``x``)."""
        local = self.matmul(x, self.weight if weight is None else weight)
        if self.comm.size == 1:
            return local[:, : self.vocab_size]
        return self.comm.all_gather(local.t().contiguous())[: self.vocab_size].t()
