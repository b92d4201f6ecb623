"""The project's size rule for its C, C++, CUDA, Metal and GLSL sources (ours, not upstream's): no file over 800 lines,
no function over 150 (split by concern, as ggml's sources are). Functions are found by brace depth at file scope,
after comments and literals are blanked: a definition is a top-level brace block whose head has a parameter list
and is not an initializer, a struct, an enum or an `extern "C"`/namespace block (whose insides are scanned)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("ggml-patches/src", "tests/c", "tests/cuda", "tests/metal", "tests/emu", "tests/fuzz")
SUFFIXES = {".c", ".cpp", ".h", ".cu", ".cuh", ".metal", ".comp", ".glsl", ".mm"}
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 150

_STRING = re.compile(r'"(\\.|[^"\\])*"')
_CHAR = re.compile(r"'(\\.|[^'\\])*'")


def _code_lines(text: str) -> list[str]:
    """The lines with comments, strings and character literals blanked (line count kept)."""
    out, in_comment = [], False
    for line in text.split("\n"):
        if in_comment:
            if "*/" not in line:
                out.append("")
                continue
            line, in_comment = line.split("*/", 1)[1], False
        line = re.sub(r"/\*.*?\*/", "", _CHAR.sub("''", _STRING.sub('""', line)))
        if "/*" in line:
            line, in_comment = line.split("/*", 1)[0], True
        out.append(line.split("//", 1)[0])
    return out


def long_functions(text: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, int, str]]:
    """(first line, length, head) of each function definition longer than limit lines."""
    lines = _code_lines(text)
    found, depth, base, start, head = [], 0, 0, None, ""
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#"):
            continue
        opens, closes = line.count("{"), line.count("}")
        if depth == base and opens > closes:
            k = i
            while k > 0 and lines[k - 1].strip() and not lines[k - 1].rstrip().endswith((";", "}", "{")) \
                    and not lines[k - 1].lstrip().startswith("#"):
                k -= 1
            head = " ".join(x.strip() for x in lines[k:i + 1])
            if re.search(r'extern\s*""\s*\{|\bnamespace\b', head):
                base += 1
                depth += opens - closes
                continue
            start = k
        depth += opens - closes
        if start is not None and depth == base:
            n = i - start + 1
            is_function = "(" in head and not re.search(r"=\s*\{|^\s*(typedef|struct|enum|union)\b", head)
            if is_function and n > limit:
                found.append((start + 1, n, head[:100]))
            start = None
        base = min(base, depth)
    return found


def _sources() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*") if p.suffix in SUFFIXES and p.is_file())


def test_scanner_finds_a_long_function_and_skips_blocks():
    body = "\n".join(f"    x += {i};" for i in range(160))
    text = (f'extern "C" {{\nstatic int f(int x) {{\n{body}\n    return x;\n}}\n}}\n'
            f"static const int table[] = {{\n{body.replace(';', ',')}\n}};\nstruct s {{\n{body}\n}};\n")
    (line, n, head), = long_functions(text)
    assert (line, n) == (2, 163) and head.startswith("static int f(int x)")
    assert long_functions("int g(void) {\n  /* { */ return '{';\n}\n") == []


def test_no_c_file_over_800_lines():
    long = {str(p.relative_to(REPO)): n for p in _sources() if (n := len(p.read_text(errors="replace").split("\n"))) > MAX_FILE_LINES}
    assert not long, f"C/C++ files over {MAX_FILE_LINES} lines (split them by concern): {long}"


def test_no_function_over_150_lines():
    long = [f"{p.relative_to(REPO)}:{line} ({n} lines): {head}"
            for p in _sources() for line, n, head in long_functions(p.read_text(errors="replace"))]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by stage):\n" + "\n".join(long)
