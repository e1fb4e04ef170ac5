"""Gateway pure logic: request checking (errors name the field), stop strings, SSE bodies."""

import pytest

from splitflash.services.gateway.api_errors import ApiError
from splitflash.services.gateway.requests import parse_json, parse_request
from splitflash.services.gateway.textstream import TextStream

MODEL = "smollm2-135m"


def parse(body, kind="completion"):
    return parse_request(body, kind, MODEL, 16)


BAD = [
    ({"prompt": 3}, "prompt", 400),
    ({}, "prompt", 400),
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", 400),
    ({"prompt": "x", "temperature": -1}, "temperature", 400),
    ({"prompt": "x", "top_p": 0}, "top_p", 400),
    ({"prompt": "x", "top_k": -2}, "top_k", 400),
    ({"prompt": "x", "stop": 5}, "stop", 400),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ({"prompt": "x", "stream": "yes"}, "stream", 400),
    ({"prompt": "x", "seed": 1.5}, "seed", 400),
    ({"prompt": "x", "n": 2}, "n", 400),
    ({"prompt": "x", "model": "gpt-9"}, "model", 404),
    ({"prompt": "x", "speculative": {"block_size": 99}}, "block_size", 400),
    ({"prompt": "x", "speculative": {"enabled": 1}}, "enabled", 400),
    ({"prompt": "x", "speculative": {"turbo": True}}, "speculative", 400),
]


@pytest.mark.parametrize("body,field,status", BAD)
def test_bad_completion_fields_are_named(body, field, status):
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == status
    assert field in info.value.message
    assert info.value.body()["error"]["message"]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ({"messages": ["x"]}, "messages[0]"),
    ],
)
def test_bad_chat_messages_are_named(body, field):
    with pytest.raises(ApiError) as info:
        parse(body, "chat")
    assert info.value.status == 400 and info.value.param == field


def test_malformed_json_and_non_object():
    for raw in (b"{not json", b"[1,2]", b"\xff\xfe"):
        with pytest.raises(ApiError) as info:
            parse_json(raw)
        assert info.value.status == 400 and info.value.code == "invalid_json"
    with pytest.raises(ApiError) as info:
        parse_json(b" " * (5 << 20))
    assert info.value.status == 413


def test_good_request_fields():
    req = parse(
        {
            "prompt": ["hello"],
            "max_tokens": 5,
            "temperature": 0,
            "stop": "\n",
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "speculative": {"enabled": False, "block_size": 4},
        }
    )
    assert (req.prompt, req.max_tokens, req.temperature, req.stop) == ("hello", 5, 0.0, ("\n",))
    assert req.stream and req.include_usage and not req.spec_enabled and req.block_size == 4


def char_decode(ids):
    return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_a_possible_stop_string_then_cuts_it():
    stream = TextStream(char_decode, ("END",))
    out = [stream.push([ord(c)]) for c in "abcEN"]
    assert "".join(out) == "abc"  # "EN" may become "END": held back
    assert stream.push([ord("D")]) == "" and stream.stopped
    stream2 = TextStream(char_decode, ("END",))
    got = "".join(stream2.push([ord(c)]) for c in "xENy") + stream2.flush()
    assert got == "xENy" and not stream2.stopped


def test_text_stream_waits_for_whole_characters():
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9!"}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(decode, ())
    assert stream.push([1]) == "caf"
    assert stream.push([2]) == ""
    assert stream.push([3]) == "é!"


def _byte_tokens(rng):
    """A byte-level tokenizer's view of a random text: tokens are byte chunks of it, in
    order (multi-byte characters split across tokens). Returns (decode, ids)."""
    words = ["Un", "café,", "plaît!", "東京", "END", "naïve", "☕", "END\n", "fin", "ff"]
    data = " ".join(rng.choice(words) for _ in range(40)).encode()
    cuts = sorted(rng.sample(range(1, len(data)), len(data) // 3))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return (lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"),
            list(range(len(pieces))))  # fmt: skip


def _sentencepiece_tokens(rng):
    """SentencePiece-like: "▁" is a space and the decoded text's leading space is dropped,
    so a token decodes differently at the start of a window than inside it. Any token
    sequence is valid text. Returns (decode, ids)."""
    pieces = ["▁the", "re", "▁é", "té", "▁END", "▁E", "ND", "!", "▁x", "yz", "▁", "\n"]
    return (lambda ids: "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" "),
            [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 120))])  # fmt: skip


def test_text_stream_equals_a_full_decode_cut_at_the_first_stop_and_decodes_a_window():
    """Spec oracle: the concatenated stream is the full decode of every token, cut at the
    earliest stop string; each push decodes a bounded window, not the whole output."""
    import random

    rng = random.Random(11)
    for trial in range(60):
        decode, ids = _byte_tokens(rng) if trial % 2 else _sentencepiece_tokens(rng)
        stop = rng.choice([(), ("END",), ("ND\n", "é"), ("東京", "ff", "!")])
        longest = [0]

        def spy(window, decode=decode, longest=longest):
            longest[0] = max(longest[0], len(window))
            return decode(window)

        stream, out, i = TextStream(spy, stop), [], 0
        while i < len(ids) and not stream.stopped:
            n = rng.choice([1, 1, 2, 5])
            out.append(stream.push(ids[i : i + n]))
            i += n
        out.append(stream.flush())
        full = decode(ids)
        hits = [at for s in stop if (at := full.find(s)) != -1]
        want = full[: min(hits)] if hits else full
        assert "".join(out) == want, (trial, stop)
        assert stream.stopped == bool(hits)
        # A window is the previous delta's tokens plus this push's (more only while a
        # character or a token's text is incomplete): never the whole output.
        assert longest[0] <= 12 or longest[0] < len(ids) // 2, (trial, longest[0], len(ids))


def test_a_gateway_batching_past_verifys_largest_graph_is_warned_at_the_handshake():
    from splitflash.services.gateway.runtime import graph_batch_warning

    warning = graph_batch_warning(64, {"graph_max_batch": "32"})
    assert warning is not None and "max_running 64 exceeds" in warning
    assert "steps of more than 32 requests run eagerly" in warning
    assert graph_batch_warning(32, {"graph_max_batch": "32"}) is None  # every step fits
    assert graph_batch_warning(64, {"graph_max_batch": "0"}) is None  # CPU: no graphs
    assert graph_batch_warning(64, {}) is None  # a worker that does not say
