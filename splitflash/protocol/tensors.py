"""Tensor frames: a small (dtype, shape) header plus the raw contiguous bytes as one frame.

Zero-copy where the memory allows it:
- encode: a contiguous CPU tensor is exposed as a memoryview of its own storage (no copy);
  a non-contiguous or GPU tensor is copied once into a contiguous CPU tensor first.
  With `send(..., copy=False)` zmq may read the buffer AFTER send returns, so the sender must
  not write into that tensor again until the frame is gone (pass a fresh tensor or a copy).
- decode: a writable buffer (a received `zmq.Frame`, a bytearray) becomes a tensor sharing its
  memory; the tensor keeps the frame alive. A read-only buffer (bytes) is copied once, since
  torch has no read-only tensors and writing into `bytes` would corrupt an immutable object.
bfloat16 has no numpy/buffer-protocol type, so it travels as its raw 2-byte pattern and is
reinterpreted on both sides; every dtype goes through a uint8 view for the same reason.
"""

from __future__ import annotations

import math
from typing import Protocol

import msgspec
import torch
import zmq

from splitflash.protocol.errors import ProtocolError

# Wire names are torch's own (str(torch.float32) without "torch."): stable and readable.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}
MAX_DIMS = 8


class TensorHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the receiver needs to rebuild a tensor frame: its dtype name and shape."""

    dtype: str
    shape: list[int]


class HasTensorHeader(Protocol):
    """Anything carrying dtype/shape fields: a `TensorHeader` or a `Features` message."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> list[int]: ...


Buffer = bytes | bytearray | memoryview | zmq.Frame


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ProtocolError(
            f"tensor dtype {dtype} cannot travel (supported: {list(_DTYPES)})"
        ) from None


def encode_tensor(t: torch.Tensor) -> tuple[TensorHeader, memoryview]:
    """(header, raw bytes) of `t`; the memoryview shares `t`'s memory when it is contiguous CPU.

    The memoryview keeps the tensor storage alive for as long as zmq holds the frame.
    """
    header = TensorHeader(dtype=dtype_name(t.dtype), shape=list(t.shape))
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    # reshape(-1) is a view for contiguous tensors and one copy otherwise; a 1-D contiguous
    # tensor can always be viewed as bytes, whatever its dtype (bf16 included).
    flat = flat.contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    return header, memoryview(raw).cast("B")


def _checked_layout(header: HasTensorHeader) -> tuple[torch.dtype, int, int]:
    """(dtype, itemsize, nbytes) of a header, refusing unknown dtypes and bad shapes."""
    dtype = _DTYPES.get(header.dtype)
    if dtype is None:
        raise ProtocolError(f"unknown tensor dtype {header.dtype!r} (supported: {list(_DTYPES)})")
    shape = header.shape
    if len(shape) > MAX_DIMS or any(not isinstance(d, int) or d < 0 for d in shape):
        raise ProtocolError(f"invalid tensor shape {shape}: at most {MAX_DIMS} dims, each >= 0")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return dtype, itemsize, math.prod(shape) * itemsize


def decode_tensor(header: HasTensorHeader, buffer: Buffer) -> torch.Tensor:
    """Rebuild a tensor from its header and raw frame; shares the frame's memory if writable.

    Raises ProtocolError when the dtype is unknown, the shape is invalid, or the buffer size
    is not prod(shape) * itemsize.
    """
    dtype, itemsize, expected = _checked_layout(header)
    view = memoryview(buffer.buffer if isinstance(buffer, zmq.Frame) else buffer)
    if view.nbytes != expected:
        raise ProtocolError(
            f"tensor frame of {view.nbytes} bytes does not match {header.dtype}{header.shape}"
            f" = {expected} bytes"
        )
    if expected == 0:
        # torch.frombuffer refuses empty buffers.
        return torch.empty(header.shape, dtype=dtype)
    view = view.cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    data = torch.frombuffer(view, dtype=torch.uint8)
    if data.data_ptr() % itemsize:
        # Tiny zmq messages live inline and may be misaligned for wider dtypes: copy them
        # into fresh (aligned) memory rather than rely on unaligned loads.
        data = data.clone()
    return data.view(dtype).reshape(header.shape)
