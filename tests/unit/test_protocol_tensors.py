"""Tensor frames: exact round trips (bf16 included), zero copy, and clear size errors."""

from __future__ import annotations

import pytest
import torch
import zmq

from splitflash.protocol import ProtocolError, TensorHeader, decode_tensor, encode_tensor
from splitflash.protocol.sockets import make_socket

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-(2**30), 2**30, shape, generator=g).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise: equal values AND dtype/shape (NaN-free inputs, so equal() is exact here).
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 7), (0,), (0, 4), (), (2, 3, 4)], ids=str)
def test_round_trip_every_buffer_kind(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _sample(dtype, shape)
    header, raw = encode_tensor(t)
    assert header == TensorHeader(dtype=str(dtype).removeprefix("torch."), shape=list(shape))
    for buf in (raw, bytes(raw), bytearray(raw)):
        assert _same(decode_tensor(header, buf), t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(dtype: torch.dtype) -> None:
    base = _sample(dtype, (6, 8))
    for t in (base.t(), base[:, ::2], base[1:4, 2:5], base.expand(2, 6, 8)):
        assert not t.is_contiguous()
        header, raw = encode_tensor(t)
        assert _same(decode_tensor(header, raw), t)


def test_bf16_bits_survive_exactly() -> None:
    bits = torch.arange(-(2**15), 2**15, 97, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)  # every kind of pattern: subnormals, inf, NaN payloads
    header, raw = encode_tensor(t)
    out = decode_tensor(header, bytes(raw))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), bits)


def test_encode_of_contiguous_tensor_is_zero_copy() -> None:
    t = torch.zeros(16, dtype=torch.float32)
    _, raw = encode_tensor(t)
    t[3] = 7.0  # the frame IS the tensor's memory
    assert decode_tensor(TensorHeader(dtype="float32", shape=[16]), bytes(raw))[3] == 7.0


def test_decode_of_writable_buffer_is_zero_copy_and_readonly_is_copied() -> None:
    buf = bytearray(encode_tensor(torch.zeros(4))[1])
    out = decode_tensor(TensorHeader(dtype="float32", shape=[4]), buf)
    buf[0:4] = torch.tensor([2.5]).numpy().tobytes()
    assert out[0] == 2.5
    frozen = bytes(4 * 4)
    copied = decode_tensor(TensorHeader(dtype="float32", shape=[4]), frozen)
    copied[0] = 1.0  # writes go to a private copy, never into the immutable bytes
    assert frozen == bytes(16)


@pytest.mark.timeout(20)
def test_through_zmq_frames_without_copy() -> None:
    ctx = zmq.Context()
    a = make_socket(ctx, "dealer", hwm=10, linger_ms=0)
    b = make_socket(ctx, "dealer", hwm=10, linger_ms=0)
    try:
        b.bind("inproc://tensors")
        a.connect("inproc://tensors")
        for dtype in DTYPES:
            for shape in ((300, 70), (1,), (0, 3)):  # large (zmq-owned) and tiny (inline) frames
                t = _sample(dtype, shape)[..., ::1]
                header, raw = encode_tensor(t)
                assert a.poll(5000, zmq.POLLOUT)
                a.send(raw, copy=False)
                assert b.poll(5000, zmq.POLLIN)
                frame = b.recv(copy=False)
                assert _same(decode_tensor(header, frame), t)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


@pytest.mark.parametrize(
    ("header", "nbytes", "needle"),
    [
        (TensorHeader(dtype="float32", shape=[2, 3]), 23, "23 bytes does not match float32"),
        (TensorHeader(dtype="float32", shape=[2, 3]), 25, "= 24 bytes"),
        (TensorHeader(dtype="bfloat16", shape=[0]), 2, "2 bytes does not match"),
        (TensorHeader(dtype="complex64", shape=[1]), 8, "unknown tensor dtype 'complex64'"),
        (TensorHeader(dtype="float32", shape=[-1, 2]), 8, "invalid tensor shape"),
        (TensorHeader(dtype="float32", shape=[1] * 9), 4, "invalid tensor shape"),
    ],
)
def test_bad_frames_raise_clear_errors(header: TensorHeader, nbytes: int, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        decode_tensor(header, bytes(nbytes))


def test_unsupported_dtype_is_refused_on_encode() -> None:
    with pytest.raises(ProtocolError, match="cannot travel"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))
