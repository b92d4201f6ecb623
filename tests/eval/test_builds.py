"""rotaryquant.eval.builds: rq-probe compiled once per build, safely when runs start together."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rotaryquant.eval import builds


def test_probes_compiled_at_once_each_get_a_whole_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "src" / "include").mkdir(parents=True)
    (tmp_path / "src" / "include" / "llama.h").write_text("// llama.h\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libllama.so").write_bytes(b"lib")
    b = builds.Build("peer", tmp_path / "bin", tmp_path / "src", (tmp_path / "lib",))
    monkeypatch.setattr(builds.paths, "build_dir", lambda: tmp_path / "build")
    outputs: list[str] = []

    def slow_compiler(cmd, **kw):  # writes its output in two halves, as a compiler may
        out = Path(cmd[cmd.index("-o") + 1])
        outputs.append(str(out))
        out.write_text("half")
        time.sleep(0.05)
        out.write_text("the whole probe")
        return builds.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(builds.subprocess, "run", slow_compiler)
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(builds.probe(b))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and len(set(got)) == 1 and got[0].read_text() == "the whole probe"
    assert len(set(outputs)) == len(outputs)  # each compile wrote a file of its own
    assert sorted(p.name for p in got[0].parent.iterdir()) == ["rq-probe"]  # no partial file left
