"""The page at `GET /` of `specextend serve`, in a real browser: Debian's Chromium (installed by
`make test-tools`) driven by Playwright, on tiny models (test_serve.py's server). Paste a document,
ask, see the answer stream; a second question shows prompt tokens from the cache; stop a long
answer (the server frees the slot); a document too long and a wrong key are messages, not blank
pages. Also the page's routes (/v1/tokenize, /v1/extract) and the prefill's progress comments in a
stream, over plain HTTP. Browser tests skip without Chromium; one runs the default pair where it is."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from specextend.models.gguf import is_current
from specextend.models.pull import DEFAULT_DRAFT, DEFAULT_TARGET, specextend_home

import loopback as http
from test_serve import folders, one_at_a_time, pair, running, slow_steps  # noqa: F401 (fixtures)

CHROMIUM = os.environ.get("SPECEXTEND_CHROMIUM", "/usr/bin/chromium")
# Headless and quiet: no GPU, no network of its own (updates, sync, QUIC), no first-run screens.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOC = "The report covers the budget of the agency, its staff and the hearings held."
HOME = specextend_home()  # the user's model cache, read before a test isolates its own
SCREENSHOT = os.environ.get("SPECEXTEND_PAGE_SCREENSHOT")  # where to save the README's picture, if set

pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file() and shutil.which(CHROMIUM) is None:
        pytest.skip(f"no Chromium at {CHROMIUM} (make test-tools installs Debian's)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def page_at(browser, url: str, width: int = 1280, height: int = 800):
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(url + "/")
        yield page
        assert not errors, errors  # no script error on the way
    finally:
        page.close()


def paste(page, text: str) -> None:
    page.get_by_role("textbox", name=re.compile("^Document")).fill(text)


def ask(page, question: str) -> None:
    box = page.get_by_role("textbox", name=re.compile("^Question"))
    box.fill(question)
    box.press("Enter")


def answers(page):
    return page.locator(".msg.assistant")


def cached_tokens(page, n: int) -> int:
    """The prompt tokens the n-th answer took from the cache, as its numbers say."""
    stats = answers(page).nth(n - 1).locator(".stats").inner_text()
    return int(re.search(r"from cache\s+([\d,]+)", stats).group(1).replace(",", ""))


def first_words(page, timeout_s: float = 30) -> None:
    """Until the first answer shows words of its own: not the "Waiting for the first token" line the
    page shows before any (with it, a test would look at the server before the request even ran)."""
    answers(page).first.locator(".body").filter(has_not=page.locator(".info"), has_text=re.compile(r"\S")).wait_for(
        timeout=timeout_s * 1000)


def wait_done(page, n: int, timeout_s: float = 60) -> None:
    """Until the n-th answer has its numbers (it has ended)."""
    page.locator(".msg.assistant .stats").nth(n - 1).wait_for(timeout=timeout_s * 1000)


# --------------------------------------------------------------------------- in the browser


def test_ask_twice_and_the_second_answer_comes_from_the_cache(browser, pair, folders):  # noqa: F811
    with running(pair, folders) as url, page_at(browser, url) as page:
        assert page.title().startswith("specextend")
        paste(page, DOC)
        page.locator("#doc-info").filter(has_text="fits").wait_for(timeout=30_000)
        ask(page, "What does the report cover?")
        first_words(page)
        wait_done(page, 1)
        first = answers(page).nth(0)
        stats = first.locator(".stats").inner_text()
        assert "first token" in stats and "tok/s" in stats and "per step" in stats and "method" in stats
        assert first.locator(".body").inner_text().strip()  # the answer streamed in
        ask(page, "And the staff?")
        wait_done(page, 2)
        assert cached_tokens(page, 2) > 0  # the document's prefill was reused
        assert page.locator(".msg.user").count() == 2


def test_stop_cancels_the_answer_on_the_server(browser, pair, folders):  # noqa: F811
    with running(pair, folders, max_queue=0, limits=one_at_a_time(0)) as url, page_at(browser, url) as page:
        slow_steps(pair, 0.1)  # 200 tokens take many seconds
        paste(page, DOC)
        page.get_by_label("Max tokens").fill("200")
        ask(page, "Tell me everything.")
        # The document prefills in steps that each sleep too; on a loaded CI machine the first words
        # can take a while, and the 200 tokens after them many seconds more.
        first_words(page, timeout_s=120)
        assert http.get(f"{url}/health").json()["running"] == 1
        page.keyboard.press("Escape")
        answers(page).first.filter(has_text="(stopped)").wait_for(timeout=10_000)
        deadline = time.time() + 10  # the server sees the client gone and ends the generation
        while http.get(f"{url}/health").json()["running"]:
            assert time.time() < deadline, "the stopped answer still runs on the server"
            time.sleep(0.05)
        assert page.get_by_role("button", name="Send").is_enabled()


def test_a_busy_server_is_a_message_with_its_wait(browser, pair, folders):  # noqa: F811
    with (running(pair, folders, max_queue=0, limits=one_at_a_time(0)) as url, page_at(browser, url) as first,
          page_at(browser, url) as second):
        slow_steps(pair, 0.5)  # the first answer holds the one slot well past the second question
        for page in (first, second):
            paste(page, DOC)
            page.get_by_label("Max tokens").fill("200")
        ask(first, "Tell me everything.")
        first_words(first)
        ask(second, "And now?")  # the one slot is taken and no request may wait
        error = second.locator(".msg.error").filter(has_text="busy")
        error.wait_for(timeout=30_000)
        assert re.search(r"try again in \d+ s", error.inner_text())
        first.keyboard.press("Escape")


def test_a_long_prefill_shows_a_bar(browser, pair, folders):  # noqa: F811
    with running(pair, folders, limits=one_at_a_time(4)) as url, page_at(browser, url) as page:
        slow_steps(pair, 0.2)  # 64 prompt tokens a step: the document takes several steps
        paste(page, "word " * 50)
        ask(page, "Summarize it.")
        bar = page.locator(".msg.assistant .progress progress")
        bar.wait_for(timeout=30_000)
        assert "Reading the document" in page.locator(".msg.assistant .progress").inner_text()
        assert float(bar.get_attribute("max")) > 0
        wait_done(page, 1)
        assert page.locator(".msg.assistant .progress").count() == 0  # gone once the answer came


def test_a_document_too_long_is_a_message(browser, pair, folders):  # noqa: F811
    with running(pair, folders) as url, page_at(browser, url) as page:
        paste(page, "word " * 2000)  # the tiny models' context is 512
        page.locator("#doc-info.bad").filter(has_text="too long").wait_for(timeout=30_000)
        ask(page, "Summarize it.")
        error = page.locator(".msg.error")
        error.wait_for(timeout=30_000)
        assert "too long" in error.inner_text()


def test_a_wrong_key_is_a_message_and_the_right_one_answers(browser, pair, folders):  # noqa: F811
    with running(pair, folders, api_keys=("right-key",)) as url, page_at(browser, url) as page:
        key = page.get_by_label("API key")
        assert key.is_visible()  # the server needs one: the page asks for it
        key.fill("wrong-key")
        paste(page, DOC)
        ask(page, "What does the report cover?")
        page.locator(".msg.error").filter(has_text="refused").wait_for(timeout=30_000)
        key.fill("right-key")
        ask(page, "What does the report cover?")
        wait_done(page, 1)
        assert page.evaluate("sessionStorage.getItem('specextend-api-key')") == "right-key"


def test_a_file_opens_as_a_document_and_documents_switch(browser, pair, folders, tmp_path):  # noqa: F811
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nThe hearings were held in May.\n")
    with running(pair, folders) as url, page_at(browser, url) as page:
        page.set_input_files("#file", str(notes))  # the empty first document takes it
        page.get_by_role("tab", name="notes.md").wait_for(timeout=10_000)
        assert "hearings were held" in page.get_by_role("textbox", name=re.compile("^Document")).input_value()
        page.get_by_role("button", name="New document").click()
        paste(page, DOC)
        assert page.get_by_role("tab").count() == 2
        page.get_by_role("tab", name="notes.md").click()
        assert "hearings were held" in page.get_by_role("textbox", name=re.compile("^Document")).input_value()


def test_the_page_fits_a_phone(browser, pair, folders):  # noqa: F811
    with running(pair, folders) as url, page_at(browser, url, width=390, height=844) as page:
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390  # no sideways scrolling
        for label in ("Method", "Max tokens", "Temperature", "Name", "Question"):
            assert page.get_by_label(label, exact=False).first.is_visible(), label


@pytest.mark.slow
def test_the_default_pair_answers_on_the_page(browser, user_cost_cache):
    """The real pair where it is in the user's model cache (skips otherwise): two questions, the second cached.
    Its step costs from the user's cost cache too (measured there on the first run, as `specextend serve` does:
    a 40 s start-up once a machine, not every run)."""
    if not all(is_current(HOME / "models" / name) for name in (DEFAULT_TARGET, DEFAULT_DRAFT)):
        pytest.skip("the default pair is not in the model cache (specextend models pull)")
    cmd = [sys.executable, "-m", "specextend.cli", "serve", "--port", "0", "--max-new-tokens", "48", "-q"]
    # Only its first lines are read: -q keeps the rest short enough for the pipe.
    env = {**os.environ, "SPECEXTEND_HOME": str(HOME), "SPECEXTEND_COST_CACHE": user_cost_cache}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        m = None
        while m is None:
            line = proc.stderr.readline()
            assert line, "the server ended before it served"
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        url = f"http://127.0.0.1:{m.group(1)}"
        deadline = time.time() + 600  # the address comes before the start-up (the batch, its measured costs)
        while not _answers(f"{url}/health"):
            assert time.time() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.5)
        serving = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
        section = serving[serving.index("## The prefix cache"):]
        with page_at(browser, url) as page:
            page.get_by_label("Name").fill("serving.md: the prefix cache")
            paste(page, section[:section.index("\n## ", 5)])
            ask(page, "How does the prefix cache decide what to reuse?")
            wait_done(page, 1, timeout_s=300)
            ask(page, "What happens when it is full?")
            wait_done(page, 2, timeout_s=300)
            assert cached_tokens(page, 2) > 0
            if SCREENSHOT:  # docs/page.png: SPECEXTEND_PAGE_SCREENSHOT=docs/page.png pytest -k default_pair
                save_small_png(page.screenshot(), SCREENSHOT)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def save_small_png(png: bytes, path: str) -> None:
    """A screenshot in 64 colours (text and flat panels lose nothing visible; the file stays small)."""
    from PIL import Image  # matplotlib's dependency

    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def _answers(url: str) -> bool:
    try:
        return http.get(url, timeout=5).status_code == 200
    except http.HTTPError:
        return False


# --------------------------------------------------------------------------- over HTTP


def test_tokenize_counts_and_says_whether_it_fits(pair, folders):  # noqa: F811
    with running(pair, folders) as url:
        ok = http.post(f"{url}/v1/tokenize", json={"messages": [{"role": "user", "content": DOC}]}).json()
        assert ok["tokens"] > 0 and ok["fits"] and ok["context"] == 512 and ok["message"] is None
        long = http.post(f"{url}/v1/tokenize", json={"messages": [{"role": "user", "content": "word " * 2000}]})
        assert long.status_code == 200 and not long.json()["fits"] and long.json()["tokens"] > 512
        assert "context of 512 tokens" in long.json()["message"]
        near = http.post(f"{url}/v1/tokenize", json={"messages": [{"role": "user", "content": "w" * 400}],
                                                      "max_tokens": 200})
        assert not near.json()["fits"] and "exceeds" in near.json()["message"]  # with the answer it would not fit
        bad = http.post(f"{url}/v1/tokenize", json={"messages": []})
        assert bad.status_code == 400 and "error" in bad.json()
        huge = http.post(f"{url}/v1/tokenize", content=b"x" * (5 << 20))
        assert huge.status_code == 413


def test_extract_reads_a_pdf_and_refuses_what_is_not_one(pair, folders):  # noqa: F811
    from pypdf import PdfWriter

    writer = PdfWriter()
    writer.add_blank_page(width=200, height=200)
    buf = io.BytesIO()
    writer.write(buf)
    with running(pair, folders) as url:
        r = http.post(f"{url}/v1/extract", content=buf.getvalue(), headers={"Content-Type": "application/pdf"})
        assert r.status_code == 200 and r.json()["pages"] == 1
        r = http.post(f"{url}/v1/extract", content=b"plain text")
        assert r.status_code == 400 and "not a PDF" in r.json()["error"]["message"]
        r = http.post(f"{url}/v1/extract", content=b"%PDF-1.7 broken")
        assert r.status_code == 400 and "error" in r.json()


def test_the_page_needs_no_key_but_its_routes_do(pair, folders):  # noqa: F811
    with running(pair, folders, api_keys=("k",)) as url:
        page = http.get(f"{url}/")
        assert page.status_code == 200 and '"needs_key": true' in page.text
        assert http.get(f"{url}/static/page.js").status_code == 200
        assert http.post(f"{url}/v1/tokenize", json={"prompt": "hi"}).status_code == 401
        assert http.post(f"{url}/v1/tokenize", json={"prompt": "hi"},
                          headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_stream_reports_the_prefill_in_comment_lines(pair, folders):  # noqa: F811
    with running(pair, folders, limits=one_at_a_time(4)) as url:  # 64-token steps: a long prompt takes several
        body = {"messages": [{"role": "user", "content": "word " * 80}], "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        with http.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        progress = [tuple(map(int, line.split()[-1].split("/"))) for line in lines if line.startswith(": prefill ")]
        usage = json.loads([x for x in lines if '"usage"' in x][-1].removeprefix("data: "))["usage"]
        assert len(progress) > 1, lines[:5]
        assert [d for d, _ in progress] == sorted(d for d, _ in progress)
        assert progress[-1] == (usage["prompt_tokens"], usage["prompt_tokens"])
        # The openai client skips the comments.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="x", messages=body["messages"], max_tokens=2, stream=True) if c.choices)
        assert text


@pytest.fixture(scope="module")
def thinking_folders(tmp_path_factory):
    """Tiny models whose template opens a thought in the generation prompt (test_reasoning.py):
    every word of a short answer is thought, sent as reasoning_content."""
    from test_reasoning import thinking_tokenizer

    from tiny_tokenizer import TINY_VOCAB, save_tiny_model

    root, tok = tmp_path_factory.mktemp("thinking-page"), thinking_tokenizer(opened=True)
    return {"target": save_tiny_model(root / "target", seed=0, vocab=TINY_VOCAB + 2, tokenizer=tok),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1, vocab=TINY_VOCAB + 2, tokenizer=tok)}


def test_a_thought_shows_above_the_answer(browser, thinking_folders):
    """A reasoning model's thought streams into a folding block (not "Waiting for the first
    token" until its answer); an answer that is all thought leaves it open, and the reader folds it."""
    from specextend.api import load

    thinking = load(thinking_folders["target"], thinking_folders["draft"], dtype="float64", progress=False)
    with running(thinking, thinking_folders) as url, page_at(browser, url) as page:
        paste(page, DOC)
        page.locator("#doc-info").filter(has_text="fits").wait_for(timeout=30_000)
        page.get_by_label("Max tokens").fill("12")
        ask(page, "What does the report cover?")
        wait_done(page, 1)
        thought = answers(page).first.locator("details.thought")
        assert thought.locator("summary").inner_text() == "Thought"
        assert thought.locator("div").inner_text().strip() and thought.get_attribute("open") is not None
        assert "Waiting" not in answers(page).first.inner_text()
        thought.locator("summary").click()  # the reader folds it
        assert thought.get_attribute("open") is None
