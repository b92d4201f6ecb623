"""The 12-prompt quality gate of the RotaryQuant paper (5 general + 7 coding prompts).

Greedy decoding (temperature 0, seed 42). An answer passes when it is long enough, contains every
expected substring (one of the alternatives of each), repeats itself at most 22% (word trigrams,
strict), and its code fences are balanced. Prompts and expectations live in eval/data/gate.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from rotaryquant import bindings, kvtypes


@dataclass
class Check:
    id: str
    passed: bool
    words: int
    repetition: float
    missing: list[str] = field(default_factory=list)
    fences_ok: bool = True
    answer: str = ""


def load_spec(path: Path | None = None) -> dict:
    text = path.read_text() if path else resources.files("rotaryquant.eval").joinpath("data/gate.json").read_text()
    return json.loads(text)


def repetition_rate(text: str, n: int = 3) -> float:
    """Share of word n-grams that repeat an earlier one (0 = none repeated, -> 1 = a loop)."""
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def check_answer(item: dict, answer: str, spec: dict) -> Check:
    words = len(answer.split())
    rep = repetition_rate(answer)
    low = answer.lower()
    missing = ["|".join(alts) for alts in item["expect"] if not any(a.lower() in low for a in alts)]
    fences_ok = answer.count("```") % 2 == 0
    passed = (words >= spec["min_words"] and not missing and rep <= spec["max_repetition"] and fences_ok
              and (not item.get("code") or answer.count("```") >= 2))
    return Check(item["id"], passed, words, round(rep, 3), missing, fences_ok, answer)


def run(model: Path, *, cache_type: str = "f16", unfused: bool = False, max_tokens: int | None = None,
        threads: int = 2, spec_path: Path | None = None, progress=print) -> dict:
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    spec = load_spec(spec_path)
    n = max_tokens or spec["max_tokens"]
    tk, tv = (bindings.type_from_name(x) for x in kvtypes.split(cache_type))
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=1024, n_threads=threads, seed=42, verbose=False,
                          flash_attn=True, type_k=tk, type_v=tv, k_center=kvtypes.k_center(cache_type),
                          kv_layer_types=kvtypes.layer_types(cache_type), kv_window=kvtypes.window(cache_type),
                          iso_unfused=unfused)
    checks = []
    for item in spec["prompts"]:
        progress(f"[rq-eval gate] {cache_type}{'-unfused' if unfused else ''}: {item['id']}")
        out = llm.create_chat_completion(messages=[{"role": "user", "content": item["prompt"]}], max_tokens=n,
                                         temperature=0.0, top_k=1, seed=42)
        checks.append(check_answer(item, out["choices"][0]["message"]["content"] or "", spec))
    del llm
    label = cache_type + ("-unfused" if unfused else "")
    return {"model": model.name, "cache": label, "max_tokens": n, "passed": sum(c.passed for c in checks),
            "total": len(checks), "checks": [asdict(c) for c in checks]}


def to_markdown(results: list[dict]) -> str:
    ids = [c["id"] for c in results[0]["checks"]]
    lines = [f"## Quality gate: {results[0]['model']}", "",
             f"Greedy, max {results[0]['max_tokens']} tokens; ✓ = length, expected substrings, repetition ≤ 0.22, fences.", "",
             "| prompt | " + " | ".join(r["cache"] for r in results) + " |", "|---|" + "---|" * len(results)]
    for i, pid in enumerate(ids):
        cells = []
        for r in results:
            c = r["checks"][i]
            cells.append("✓" if c["passed"] else "✗ " + ", ".join(
                ([f"missing {m}" for m in c["missing"]]) + ([f"rep {c['repetition']}"] if c["repetition"] > 0.22 else [])
                + (["fences"] if not c["fences_ok"] else []) + ([f"{c['words']} words"] if c["words"] < 12 else [])))
        lines.append(f"| {pid} | " + " | ".join(cells) + " |")
    lines.append("| **passed** | " + " | ".join(f"**{r['passed']}/{r['total']}**" for r in results) + " |")
    return "\n".join(lines) + "\n"
