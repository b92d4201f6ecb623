"""llama-server's web UI, built from the sdist's own source (``vendor/llama.cpp/tools/ui``).

Upstream's CMake embeds the UI from the first of: pre-built assets in ``tools/ui/dist``, an npm build
in the build folder (``LLAMA_BUILD_UI``), or a download of prebuilt assets (``LLAMA_USE_PREBUILT_UI``;
impossible here). Set-up takes the first route with upstream's own recipe: ``npm ci`` (the lockfile) and
``npm run build`` in a staged copy, the output kept in ``<cache>/ui/<key>/dist`` and ``tools/ui/dist``
linked to it, so every build folder (cpu, vulkan, cuda) embeds the same assets and a fresh clone or a
second set-up rebuilds nothing. The key hashes the UI's source files (package-lock.json among them), the
node major version and the build label; builds of other keys stay (~10 MB each) for other clones. Without
npm, or when the npm build fails, set-up says so in one line and llama-server is built without the UI,
as upstream does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import git, log

UI_REL = "vendor/llama.cpp/tools/ui"
NPM_TIMEOUT_S = 1200  # per npm command; a registry that does not answer ends in a UI-less build
NO_UI_ENV = "RQ_NO_UI"


def ui_source() -> Path:
    return paths.src_root() / UI_REL


def dist_link() -> Path:
    """The folder upstream's scripts/ui-assets.cmake embeds before anything else."""
    return ui_source() / "dist"


def ui_cache() -> Path:
    return paths.cache_dir() / "ui"


def source_files(root: Path) -> list[str]:
    """The UI's source: files git tracks or would track under tools/ui (its .gitignore leaves out
    node_modules, dist and the generated icons), relative to tools/ui, sorted."""
    out = git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", UI_REL)
    rels = {p[len(UI_REL) + 1:] for p in out.split("\0") if p}
    return sorted(r for r in rels if (root / UI_REL / r).is_file())


def source_key(src: Path, files: list[str], extra: str) -> str:
    """SHA-256 over the names and bytes of files (relative to src) and extra; 16 hex digits."""
    h = hashlib.sha256(extra.encode() + b"\0")
    for rel in files:
        h.update(rel.encode() + b"\0")
        h.update(hashlib.sha256((src / rel).read_bytes()).digest())
    return h.hexdigest()[:16]


def node_major(npm: str) -> str | None:
    """`node --version`'s major number (v20.20.2 -> "20"), from the node beside npm; None without node."""
    node = shutil.which("node", path=str(Path(npm).parent)) or shutil.which("node")
    if not node:
        return None
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().lstrip("v").split(".")[0] or None


def link_dist(target: Path | None) -> None:
    """Point tools/ui/dist at target (None: remove it, so the build embeds no UI)."""
    link = dist_link()
    if link.is_symlink() and target is not None and link.resolve() == target.resolve():
        return
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.exists():
        shutil.rmtree(link)
    if target is not None:
        link.symlink_to(target)


def _npm(npm: str, args: list[str], cwd: Path, env: dict[str, str], logf: Path) -> str | None:
    """Run npm; None when it succeeded, else one line saying why not."""
    with logf.open("a") as fh:
        fh.write(f"$ npm {' '.join(args)}\n")
        fh.flush()
        try:
            rc = subprocess.run([npm, *args], cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=NPM_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            return f"`npm {args[0]}` ran past {NPM_TIMEOUT_S} s"
        except OSError as e:
            return f"`npm {args[0]}` could not run ({e})"
    return None if rc == 0 else f"`npm {' '.join(args)}` failed (exit {rc})"


def stage(src: Path, files: list[str], work: Path) -> None:
    """Copy the source files (the hashed ones, nothing generated) to work."""
    for rel in files:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, work / rel)


def build_ui(npm: str, src: Path, files: list[str], out: Path, label: str) -> str | None:
    """npm ci + npm run build of src's files into out/dist, staged in out.tmp (node_modules removed
    after); None on success, else one line saying what failed."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    work = tmp / "src"
    stage(src, files, work)
    logf = ui_cache() / "npm.log"
    logf.write_text("")
    env = dict(os.environ, npm_config_cache=str(ui_cache() / "npm-cache"), npm_config_audit="false",
               npm_config_fund="false", npm_config_update_notifier="false",
               # what scripts/ui-assets.cmake passes to `npm run build`
               LLAMA_UI_OUT_DIR=str(tmp / "dist"), LLAMA_BUILD_NUMBER=label)
    why = _npm(npm, ["ci"], work, env, logf) or _npm(npm, ["run", "build"], work, env, logf)
    if why is None and not (tmp / "dist" / "index.html").exists():
        why = "`npm run build` wrote no index.html"
    if why is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"{why}; log: {logf}"
    shutil.rmtree(work)  # node_modules: ~700 MB; npm's own cache keeps the packages
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return None


def ensure_ui(label: str, skip: bool = False) -> bool:
    """Build (or reuse) the web UI and link it as tools/ui/dist; False when the build will have no UI."""
    if skip or os.environ.get(NO_UI_ENV, "") not in ("", "0"):
        link_dist(None)
        log("UI: skipped (--no-ui / RQ_NO_UI): llama-server is built without the web UI")
        return False
    npm = shutil.which("npm")
    major = node_major(npm) if npm else None
    if not npm or not major:
        link_dist(None)
        log("UI: npm/node not found: llama-server is built without the web UI "
            "(install Node.js >= 20 with npm, e.g. apt-get install nodejs npm, and re-run set-up)")
        return False
    root, src = paths.src_root(), ui_source()
    files = source_files(root)
    key = source_key(src, files, f"node{major}|{label}")
    out = ui_cache() / key
    if (out / "dist" / "index.html").exists():
        link_dist(out / "dist")
        return True
    ui_cache().mkdir(parents=True, exist_ok=True)
    log(f"UI: building llama-server's web UI from {src} (npm ci + npm run build: a few minutes, once; "
        f"cached in {out})")
    t0 = time.time()
    why = build_ui(npm, src, files, out, label)
    if why is not None:
        link_dist(None)
        log(f"UI: {why}: llama-server is built without the web UI")
        return False
    link_dist(out / "dist")
    log(f"UI: built in {time.time() - t0:.0f} s")
    return True
