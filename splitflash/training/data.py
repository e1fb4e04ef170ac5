"""Training prompts from what is already on this machine (no downloads): Python source and
docstrings of the standard library, installed packages' READMEs / descriptions, and text
under /usr/share/doc, each wrapped in a chat instruction. A stable hash of the source file
puts every prompt in `train` or `eval`, so held-out prompts never share a file with training.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CODE_ASKS = (
    "Explain what this Python code does.",
    "Summarise this code in a few sentences.",
    "Review this code and suggest improvements.",
    "Write a docstring for this code.",
    "Describe the inputs and outputs of this code.",
    "Rewrite this code to be simpler, and explain the changes.",
)
TEXT_ASKS = (
    "Summarise this text.",
    "Explain this text in simple words.",
    "List the key points of this text.",
    "Continue this text.",
    "Write three questions about this text and answer them.",
    "Continue this story.",
)
FUNC_ASK = "Write a Python function `{name}{sig}` that does the following: {doc}"
MAX_DOC_CHARS = 1200  # ~300 tokens: prompt + a 256-token response fit a 640-token row


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str  # code | text | func
    source: str  # file it came from (the train/eval split key)


def split_of(source: str, eval_every: int = 20) -> str:
    digest = int(hashlib.sha1(source.encode()).hexdigest()[:8], 16)
    return "eval" if digest % eval_every == 0 else "train"


def _code_chunks(text: str) -> Iterator[str]:
    """Top-level definitions (40 lines at most each), the units one asks about."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith(("def ", "class ", "async def "))]
    if not starts:
        return
    for a, b in zip(starts, starts[1:] + [len(lines)], strict=False):
        chunk = "\n".join(lines[a : min(b, a + 40)]).strip()
        if 120 <= len(chunk) <= MAX_DOC_CHARS:
            yield chunk


def _functions(text: str) -> Iterator[tuple[str, str, str]]:
    """(name, signature, first docstring paragraph) of documented functions."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node) or ""
            first = doc.split("\n\n")[0].replace("\n", " ").strip()
            if 30 <= len(first) <= 400:
                yield node.name, f"({ast.unparse(node.args)})", first


def _paragraph_chunks(text: str) -> Iterator[str]:
    chunk = ""
    for para in text.split("\n\n"):
        para = para.strip()
        if not para:
            continue
        if len(chunk) + len(para) > MAX_DOC_CHARS and chunk:
            if len(chunk) >= 300:
                yield chunk
            chunk = ""
        chunk = f"{chunk}\n\n{para}" if chunk else para[:MAX_DOC_CHARS]
    if len(chunk) >= 300:
        yield chunk


def _read_text(path: Path) -> str:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, gzip.BadGzipFile, EOFError):
        return ""


def _text_files(roots: list[Path]) -> Iterator[Path]:
    names = ("readme", "changes", "news", "history", "tutorial", "guide", "faq", "howto")
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            low = path.name.lower()
            if (
                path.is_file()
                and (low.endswith((".md", ".md.gz", ".rst", ".txt")) or low.startswith(names))
                and path.stat().st_size < 2**20
            ):
                yield path


def _metadata_descriptions(site: Path) -> Iterator[tuple[str, str]]:
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        body = _read_text(meta).split("\n\n", 1)
        if len(body) == 2:
            yield str(meta), body[1]


def collect_prompts(seed: int = 0, limit: int | None = None) -> list[Prompt]:
    """Every prompt the local sources give, shuffled (seeded)."""
    out: list[Prompt] = []
    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        text = _read_text(path)
        for chunk in _code_chunks(text):
            ask = rng.choice(CODE_ASKS)
            out.append(Prompt(f"{ask}\n\n```python\n{chunk}\n```", "code", str(path)))
        for name, sig, doc in _functions(text):
            out.append(Prompt(FUNC_ASK.format(name=name, sig=sig, doc=doc), "func", str(path)))
    docs = [(str(p), _read_text(p)) for p in _text_files([Path("/usr/share/doc"), site])]
    for source, text in docs + list(_metadata_descriptions(site)):
        for chunk in _paragraph_chunks(text):
            out.append(Prompt(f"{rng.choice(TEXT_ASKS)}\n\n{chunk}", "text", source))
    rng.shuffle(out)
    return out[:limit] if limit else out


def balanced(prompts: list[Prompt], n: int) -> list[Prompt]:
    """Up to n prompts taken round-robin over kinds, so text chunks (the most numerous
    source) do not crowd out code."""
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    queues = [iter(v) for _, v in sorted(by_kind.items())]
    out: list[Prompt] = []
    while queues and len(out) < n:
        for q in list(queues):
            item = next(q, None)
            if item is None:
                queues.remove(q)
            elif len(out) < n:
                out.append(item)
    return out


def write_prompts(prompts: list[Prompt], tokenizer, out_file: Path, max_prompt_tokens: int) -> int:
    """Tokenise with the chat template; one JSON object per line. Returns the count kept."""
    from splitflash.cli.generate import encode_prompt

    out_file.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    tmp = out_file.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in prompts:
            ids = encode_prompt(tokenizer, p.text, chat=True)
            if len(ids) > max_prompt_tokens:
                continue
            row = {"ids": ids, "kind": p.kind, "split": split_of(p.source), "source": p.source}
            f.write(json.dumps(row) + "\n")
            kept += 1
    tmp.replace(out_file)  # a half-written prompt file is never mistaken for a finished one
    return kept


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
