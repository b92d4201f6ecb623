"""tests/helpers/chromium_cdp.py: headless Chromium over CDP; and with it llama-server's embedded web UI, used as a person
uses it (type a question, Enter, read the streamed answer) on a calibrated Gemma3 with the recommended
isoquant4_0 K / isoquant3_0 V cache. The screenshot goes to build/webui.png (RQ_WEBUI_SCREENSHOT=path to
write it elsewhere, e.g. docs/img/webui.png for the README)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rotaryquant import paths
from rotaryquant.build import tools, ui

# Greedy Gemma3-270M answers "Tell me about the Moon." with one sentence on a loop even from an f16 cache, so a
# question it answers sanely from f16 (and from both CPU kernels of the compressed cache, checked 2026-12-04)
QUESTION = "Tell me about the Sun."
# Gemma3-270M is a base model without a chat template (llama-server would fall back to ChatML, which it
# answers with <|im_end|> tokens): a plain question/answer frame, and -r "Question:" ends each answer
QA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] | trim }}\n"
               "Answer:{% elif m['role'] == 'assistant' %} {{ m['content'] | trim }}\n\n{% endif %}{% endfor %}")
ANSWER_JS = """(() => {
  const els = document.querySelectorAll('[aria-label="Assistant message with actions"]');
  if (!els.length) return '';
  const c = els[els.length - 1].cloneNode(true);   // the message without its statistics and buttons
  c.querySelectorAll('.info, button').forEach(e => e.remove());
  return c.innerText.trim();
})()"""


@pytest.fixture(scope="module")
def chromium_exe() -> str:
    exe = tools.ensure_chromium()
    if exe is None:
        pytest.skip("Chromium is not installed and could not be (apt-get install chromium needs root and apt)")
    return exe


def test_chromium_types_like_a_keyboard_and_takes_screenshots(chromium_exe, tmp_path):
    from chromium_cdp import chromium

    page_html = ("<textarea id=t></textarea><p id=sent></p><script>document.getElementById('t').addEventListener("
                 "'keydown', e => { if (e.key === 'Enter') document.getElementById('sent').textContent = "
                 "document.getElementById('t').value; });</script>")
    (tmp_path / "p.html").write_text(page_html)
    with chromium(chromium_exe) as page:
        page.goto((tmp_path / "p.html").as_uri())
        page.type_text("#t", "hello there")
        page.press_enter()
        assert page.wait_for("document.getElementById('sent').textContent", 10, "no Enter") == "hello there"
        shot = page.screenshot(tmp_path / "shot.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@contextmanager
def web_server(model: Path, template: Path) -> Iterator[tuple[str, Path]]:
    """llama-server with its web UI (what a user runs), the recommended cache, greedy, short answers."""
    from rotaryquant.eval.serve import launch

    cmd = [str(paths.bin_dir() / "llama-server"), "-m", str(model), "-c", "2048", "-np", "1", "-t", "2",
           "-fa", "on", "-ctk", "isoquant4_0", "-ctv", "isoquant3_0", "--metrics", "-lv", "4",
           "-n", "64", "--temp", "0", "--chat-template-file", str(template), "-r", "Question:"]
    with launch(cmd, web_ui=True, error=AssertionError) as (base, _pid, log):
        yield base, log


@pytest.fixture(scope="module")
def gemma3_kc(gemma3, tmp_path_factory) -> Path:
    """Gemma3-270M with rq-calibrate's K statistics (512 tokens), named as the README names it."""
    from rotaryquant.converter import kcenter

    out = tmp_path_factory.mktemp("kc") / "gemma-3-270m.kc.gguf"
    kcenter.calibrate(gemma3, out, n_tokens=512, n_ctx=512, progress=False)
    return out


@pytest.mark.slow
def test_web_ui_chat_streams_an_answer_from_the_isoquant_cache(chromium_exe, gemma3_kc, tmp_path,
                                                               sane_text):
    from chromium_cdp import chromium
    from rotaryquant.eval.serve import metrics

    if not (ui.dist_link() / "index.html").exists():
        pytest.skip("this build has no web UI (set-up without npm, or with --no-ui / RQ_NO_UI)")
    template = tmp_path / "qa.jinja"
    template.write_text(QA_TEMPLATE)
    shot = Path(os.environ.get("RQ_WEBUI_SCREENSHOT") or paths.build_dir() / "webui.png")
    with web_server(gemma3_kc, template) as (base, log), \
            chromium(chromium_exe, width=1100, height=640) as page:
        page.goto(base + "/")
        page.wait_for("!!document.querySelector('textarea')", 60, "the chat box did not appear")
        assert page.evaluate("document.title") == "llama-ui"
        page.type_text("textarea", QUESTION)
        page.press_enter()
        # streamed: the answer appears while the server still generates; done when the server is idle
        page.wait_for(ANSWER_JS, 300, "no answer appeared")
        deadline = time.time() + 300
        while (m := metrics(base))["requests_processing"] > 0 or m["tokens_predicted_total"] == 0:
            assert time.time() < deadline, "the answer did not finish in 300 s"
            time.sleep(0.5)
        answer, prev = page.evaluate(ANSWER_JS), None
        while answer != prev:  # the UI has rendered the last chunk
            time.sleep(1)
            prev, answer = answer, page.evaluate(ANSWER_JS)
        page.screenshot(shot)
        server_log = log.read_text()
        asked = page.evaluate("document.body.innerText")
    assert QUESTION in asked
    assert "<|" not in answer and "<end_of_turn>" not in answer, answer
    assert sane_text(answer), answer
    # the recommended cache served it: K centred from the file's statistics, fused attention on packed K/V
    assert "K (isoquant4_0)" in server_log and "V (isoquant3_0)" in server_log
    assert "K centring = on (rotaryquant.k_center" in server_log
    assert m["isoquant_fused_calls_total"] > 0 and m["isoquant_dequant_rows_total"] == 0, m
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
