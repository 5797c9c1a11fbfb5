"""The /ui playground in Debian's Chromium (Playwright) against a real `dloserve serve`.

One service for the module, in a subprocess with its own Ray cluster: the demo model, DP2
AllGather DLO, two API keys, and limits that differ from the defaults, so a hint the page
shows can only have come from this instance's /openapi.json. Every page runs under the
page's own Content-Security-Policy (so the policy is shown not to break the page), except
the escaping test, which turns it off: there the page's own rendering must keep a prompt
inert, not the policy. Screenshots go to out/ui/ (make ui-check).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.hostproc import descendants, matching
from tests.api.conftest import Serve, _started
from tests.api.uipage import ARGS, CHROMIUM, Page, auth, wait_final
from tests.conftest import free_port

pytestmark = pytest.mark.browser

KEY_A, KEY_B = "sk-ui-alice-0123456789", "sk-ui-bob-9876543210"
LIMITS = {"--max-width": "640", "--max-height": "480", "--max-pixels": "200000", "--max-frames": "33",
          "--max-steps": "150"}


@contextmanager
def _serving(results: Path, *extra: str) -> Iterator[tuple[str, Serve]]:
    """A `dloserve serve` of the demo model (DP2 AllGather, two keys); stopped and checked after."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths
    port = free_port()
    limits = [x for kv in LIMITS.items() for x in kv]
    s = Serve(ray_tmp, "--port", str(port), "--data-parallel-size", "2",
              "--enable-distributed-layerwise-offload", "--dlo-mode", "allgather", "--cpus-per-rank", "0.5",
              "--api-key", KEY_A,
              "--api-key", KEY_B, "--drain-timeout-s", "10",
              "--results-dir", str(results), *limits, *extra)
    _started.remove(s)  # it outlives one test: this fixture stops it, not the per-test clean-up
    try:
        s.watch_until(lambda: "dloserve ready at" in s.output, timeout=400)
        yield f"http://127.0.0.1:{port}", s
    finally:
        from service.api.hostproc import kill_tree

        if s.proc.poll() is None:
            s.stop(signal.SIGTERM)
        left = s.survivors()
        kill_tree([s.proc.pid, *s.seen], grace_s=5)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert not left, left


@pytest.fixture(scope="module")
def served(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Serve]]:
    """With one adapter registered at start (every key may use it)."""
    from service.models.demo.lora import write_demo_lora

    lora = tmp_path_factory.mktemp("ui-loras") / "style.safetensors"
    write_demo_lora(demo_model, lora, rank=4)
    flags = (demo_model, "--lora", f"style={lora}")
    with _serving(tmp_path_factory.mktemp("ui-results"), *flags) as it:
        yield it


@pytest.fixture
def drained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Serve]]:
    """An instance of its own for the test that stops it: the others' stays up in any order."""
    with _serving(tmp_path_factory.mktemp("ui-drain")) as it:
        yield it


@pytest.fixture(scope="module")
def service(served: tuple[str, Serve]) -> str:
    return served[0]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make setup-system` (Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def tab(browser: Any, service: str) -> Iterator[Any]:
    """tab(width=..., key=...) opens a Page; every page opened is closed and checked."""
    pages: list[Page] = []

    def open_page(url: str | None = None, **kw: Any) -> Page:
        pages.append(Page(browser, url or service, **kw))
        return pages[-1]

    yield open_page
    for p in pages:
        p.close()


def test_the_page_is_served_by_the_service_with_a_strict_policy(service: str) -> None:
    r = httpx.get(f"{service}/ui")
    assert r.status_code == 308 and r.headers["location"] == "ui/"
    page = httpx.get(f"{service}/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{service}/ui/app.js").headers["content-type"].startswith("text/javascript")
    for bad in ("__init__.py", "..%2Fapp.py", "nothing.js", "index.HTML"):
        assert httpx.get(f"{service}/ui/{bad}").status_code == 404, bad
    assert not [p for p in httpx.get(f"{service}/openapi.json").json()["paths"] if p.startswith("/ui")]


def test_the_instance_limits_are_shown_before_submit(tab: Any) -> None:
    p = tab(key=KEY_A)
    assert "16–640 px" in p.text("#hint-width") and "multiple of 16" in p.text("#hint-width")
    assert "16–480 px" in p.text("#hint-height")
    assert "200,000 pixels" in p.text("#hint-size")
    assert "… 33 (4k + 1)" in p.text("#hint-num_frames")
    assert "1–150" in p.text("#hint-num_inference_steps")
    assert "2,000 characters" in p.text("#hint-prompt")
    width = p.js("(() => { const e = document.getElementById('f-width'); return [e.min, e.max, e.step]; })()")
    assert width == ["16", "640", "16"]
    assert p.js("document.getElementById('field-input_reference').hidden")  # the API takes no image yet


def test_submit_watch_play_download_remix_delete(tab: Any, service: str) -> None:
    p = tab(key=KEY_A)
    p.js("window.__seen = []; window.__previews = new Set(); "
         "setInterval(() => { window.__seen.push(document.getElementById('job-progress').value); "
         "const img = document.getElementById('job-preview'); "
         "if (!img.hidden && img.src.startsWith('blob:')) window.__previews.add(img.src); }, 40)")
    vid = p.submit(prompt="a red fox running through snow", negative_prompt="blurry", width=48, height=32,
                   num_frames=9, num_inference_steps=40, guidance_scale=4.5, seed=11)
    # While it runs: the service panel names the rank that holds it (from the video's dp_rank).
    rank = p.until(f"[...document.querySelectorAll('#svc-groups li')].find(li => li.textContent.includes("
                   f"{vid[:14]!r}))?.dataset.rank", timeout=120)
    p.wait_completed()
    seen = p.js("window.__seen")
    assert seen[-1] == 100 and seen == sorted(seen), seen
    assert [v for v in seen if 0 < v < 100], "no live progress between 0 and 100"
    # Its preview showed beside the bar while it ran (the image's URL changes with each new one),
    # and the player took its place at the end.
    assert p.js("window.__previews.size") >= 1 and p.js("document.getElementById('job-preview').hidden")
    api = httpx.get(f"{service}/v1/videos/{vid}", headers=auth(KEY_A)).json()
    assert api["status"] == "completed" and str(api["dp_rank"]) == rank
    # Time in queue and on the rank, from the assignment history.
    meta = p.until("(() => { const m = Object.fromEntries([...document.querySelectorAll('#job-meta dt')]"
                   ".map(dt => [dt.textContent, dt.nextElementSibling.textContent]));"
                   " return m['on the rank'] ? m : null; })()")
    rec = next(r for r in httpx.get(f"{service}/v1/waves", headers=auth(KEY_A)).json() if vid in r["ids"])
    assert float(meta["in queue"].removesuffix(" s")) == rec["queued_s"]
    assert float(meta["on the rank"].removesuffix(" s")) == rec["latency_s"] > 0
    assert meta["seed"] == "11" and meta["size"] == "48x32" and meta["rank"] == rank
    played = p.page.evaluate("""async () => {
        const v = document.getElementById('job-video');
        await v.play();
        await new Promise(r => setTimeout(r, 500));
        return {t: v.currentTime, d: v.duration, e: v.error && v.error.code,
                w: v.videoWidth, h: v.videoHeight};
    }""")
    assert played["d"] > 0 and played["t"] > 0 and played["e"] is None, played
    assert (played["w"], played["h"]) == (48, 32), played
    with p.page.expect_download() as dl:
        p.page.click("#job-download")
    content = httpx.get(f"{service}/v1/videos/{vid}/content", headers=auth(KEY_A))
    assert content.status_code == 200 and Path(dl.value.path()).read_bytes() == content.content
    assert dl.value.suggested_filename == f"{vid}.mp4"

    p.page.click("#clear-form")
    p.page.click("#job-remix")
    values = p.js("Object.fromEntries([...document.querySelectorAll('#create-form [name]')]"
                  ".filter(e => e.type !== 'file').map(e => [e.name, e.value]))")
    assert values == {"prompt": "a red fox running through snow", "negative_prompt": "blurry", "width": "48",
                      "height": "32", "num_frames": "9", "fps": str(api["fps"]), "num_inference_steps": "40",
                      "guidance_scale": "4.5", "seed": "11", "cache": "", "cache_threshold": "",
                      "priority": "0"}
    assert p.js("document.activeElement.id") == "f-prompt"

    p.page.click("#job-delete")
    p.until(f"!document.querySelector('#jobs-list li[data-id=\"{vid}\"]')"
            " && document.getElementById('job-view').hidden")
    assert p.text("#jobs-done") == f"Deleted {vid}."
    assert httpx.get(f"{service}/v1/videos/{vid}", headers=auth(KEY_A)).status_code == 404


def test_adapters_and_a_cache_are_sent_shown_and_remixed(tab: Any, service: str) -> None:
    p = tab(key=KEY_A)
    p.until("document.querySelector('#lora-list .lora-row')?.dataset.name === 'style'")
    assert "Up to " in p.text("#hint-loras")
    assert not p.js("document.getElementById('field-cache').hidden")
    assert p.js("document.getElementById('field-cache_threshold').hidden")  # first block only
    fields = {"prompt": "a fox in a style", "width": 48, "height": 32, "num_frames": 9,
              "num_inference_steps": 3, "seed": 5}
    p.fill(**fields)
    p.page.check("#lora-use-0")
    p.page.fill("#lora-scale-0", "0.5")
    p.page.select_option("#f-cache", "first_block")
    assert not p.js("document.getElementById('field-cache_threshold').hidden")
    p.page.fill("#f-cache_threshold", "0.1")
    vid = p.submit()
    p.wait_completed()
    api = httpx.get(f"{service}/v1/videos/{vid}", headers=auth(KEY_A)).json()
    assert api["loras"] == [{"name": "style", "scale": 0.5, "expert": None}], api
    assert api["cache"]["method"] == "first_block" and api["cache"]["threshold"] == 0.1, api
    # the page sent what the API takes as JSON: the same request there gives the same bytes
    body = {**fields, "loras": [{"name": "style", "scale": 0.5}],
            "cache": {"method": "first_block", "threshold": 0.1}}
    direct = httpx.post(f"{service}/v1/videos", json=body, headers=auth(KEY_A)).json()["id"]
    assert wait_final(service, direct, KEY_A)["status"] == "completed"
    got, want = (httpx.get(f"{service}/v1/videos/{v}/content", headers=auth(KEY_A)).content
                 for v in (vid, direct))
    assert got == want
    plain = httpx.post(f"{service}/v1/videos", json=fields, headers=auth(KEY_A)).json()["id"]
    assert wait_final(service, plain, KEY_A)["status"] == "completed"
    assert httpx.get(f"{service}/v1/videos/{plain}/content", headers=auth(KEY_A)).content != got
    meta = p.js("Object.fromEntries([...document.querySelectorAll('#job-meta dt')]"
                ".map(dt => [dt.textContent, dt.nextElementSibling.textContent]))")
    assert meta["adapters"] == "style × 0.5" and meta["cache"] == "first_block 0.1", meta
    p.page.click("#clear-form")
    assert not p.js("document.getElementById('lora-use-0').checked")
    p.page.click("#job-remix")
    ids = ("lora-use-0", "lora-scale-0", "f-cache", "f-cache_threshold")
    got_back = "[" + ", ".join(f"document.getElementById('{i}')" for i in ids) + "]"
    values = p.js(got_back + ".map(e => e.type === 'checkbox' ? e.checked : e.value)")
    assert values == [True, "0.5", "first_block", "0.1"], values
    # a refused threshold is shown beside the cache, in the server's words
    p.page.fill("#f-cache_threshold", "99")
    p.page.click("#submit")
    p.until("document.getElementById('err-cache').textContent !== ''")
    form = {**{k: str(v) for k, v in fields.items()}, "cache": '{"method": "first_block", "threshold": 99}'}
    refused = httpx.post(f"{service}/v1/videos", data=form, headers=auth(KEY_A)).json()["error"]
    assert refused["param"] == "cache.threshold" and p.text("#err-cache") == refused["message"]
    assert p.js("document.activeElement.id") == "f-cache_threshold"
    p.shot("adapters")
    for v in (vid, direct, plain):
        httpx.delete(f"{service}/v1/videos/{v}", headers=auth(KEY_A))


def test_a_priority_is_sent_shown_on_the_card_and_remixed(tab: Any, service: str) -> None:
    p = tab(key=KEY_B)
    assert "-100–100" in p.text("#hint-priority") and "lower runs first" in p.text("#hint-priority")
    assert p.js("[document.getElementById('f-priority').min, document.getElementById('f-priority').max]") \
        == ["-100", "100"]
    fields = {"prompt": "an urgent fox", "width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2}
    with p.page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/v1/videos")) as sent:
        vid = p.submit(**fields, priority=3)
    assert 'name="priority"\r\n\r\n3\r\n' in sent.value.post_data
    p.wait_completed()
    assert httpx.get(f"{service}/v1/videos/{vid}", headers=auth(KEY_B)).json()["priority"] == 3
    meta = p.js("Object.fromEntries([...document.querySelectorAll('#job-meta dt')]"
                ".map(dt => [dt.textContent, dt.nextElementSibling.textContent]))")
    assert meta["priority"] == "3", meta
    card = f"#jobs-list li[data-id=\"{vid}\"] .sub"
    p.until(f"document.querySelector({card!r})?.textContent.includes('priority 3')")
    p.page.click("#clear-form")
    p.page.click("#job-remix")
    assert p.js("document.getElementById('f-priority').value") == "3"
    # better than the key's floor (0): the server's 422 beside the field, nothing queued
    p.page.fill("#f-priority", "-1")
    p.page.click("#submit")
    p.until("document.getElementById('err-priority').textContent !== ''")
    form = {**{k: str(v) for k, v in fields.items()}, "priority": "-1"}
    refused = httpx.post(f"{service}/v1/videos", data=form, headers=auth(KEY_B)).json()["error"]
    assert refused["param"] == "priority" and p.text("#err-priority") == refused["message"]
    assert p.js("document.activeElement.id") == "f-priority"
    # empty: not sent (the service's default, 0 for this key)
    p.page.fill("#f-priority", "")
    with p.page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/v1/videos")) as sent:
        plain = p.submit()
    assert 'name="priority"' not in sent.value.post_data
    assert wait_final(service, plain, KEY_B)["priority"] == 0
    for v in (vid, plain):
        httpx.delete(f"{service}/v1/videos/{v}", headers=auth(KEY_B))


def test_a_late_refusal_sent_before_the_key_leaves_the_key_and_the_form(tab: Any, service: str) -> None:
    """The page's first calls go out without a key; their 401 may come after one is set."""
    p = tab(hold="**/v1/loras")
    p.until("document.getElementById('hint-width').textContent !== ''")
    assert p.held, "the keyless adapter list was not sent"
    p.use_key(KEY_A)
    p.until("document.querySelector('#lora-list .lora-row')")  # the keyed list came first
    p.fill(prompt="typed before a late 401", width=32, height=32, num_frames=5, num_inference_steps=1)
    with p.page.expect_response(lambda r: r.status == 401):
        for route in p.held:
            route.continue_()
    vid = p.submit()
    assert p.text("#key-msg") == "Key set for this browser tab."
    assert wait_final(service, vid, KEY_A)["prompt"] == "typed before a late 401"
    httpx.delete(f"{service}/v1/videos/{vid}", headers=auth(KEY_A))


@pytest.mark.parametrize(("fields", "param", "shown_at"), [
    ({"prompt": "x", "width": 33, "height": 32}, "width", "width"),  # sizes are multiples of 16
    ({"prompt": "", "width": 32}, "prompt", "prompt"),
    ({"prompt": "x", "width": 640, "height": 480}, "size", "size"),  # over the pixel budget
    ({"prompt": "x", "num_frames": 6}, "num_frames", "num_frames"),
])
def test_a_4xx_is_shown_beside_the_field_it_names(tab: Any, service: str, fields: dict, param: str,
                                                  shown_at: str) -> None:
    body = {k: v for k, v in fields.items() if v != ""}
    direct = httpx.post(f"{service}/v1/videos", data={k: str(v) for k, v in body.items()},
                        headers=auth(KEY_B))
    assert direct.status_code == 422 and direct.json()["error"]["param"] == param, direct.text
    p = tab(key=KEY_B)
    before = len(httpx.get(f"{service}/v1/videos?limit=100", headers=auth(KEY_B)).json()["data"])
    p.fill(**fields)
    p.page.click("#submit")
    p.until(f"document.getElementById('err-{shown_at}').textContent !== ''")
    assert p.text(f"#err-{shown_at}") == direct.json()["error"]["message"]  # the server's own words
    others = p.js(f"[...document.querySelectorAll('#create-form .err')].filter(e => e.id !== 'err-{shown_at}'"
                  " && e.textContent).map(e => e.id)")
    assert others == []
    focus = "width" if shown_at == "size" else shown_at
    assert p.js("document.activeElement.id") == f"f-{focus}"
    assert p.js(f"document.getElementById('f-{focus}').getAttribute('aria-invalid')") == "true"
    assert len(httpx.get(f"{service}/v1/videos?limit=100", headers=auth(KEY_B)).json()["data"]) == before


def test_a_wrong_key_shows_nothing_of_another_keys_jobs(tab: Any, service: str) -> None:
    r = httpx.post(f"{service}/v1/videos", json={"prompt": "alice's secret fox", "seed": 3},
                   headers=auth(KEY_A))
    vid = r.json()["id"]
    wait_final(service, vid, KEY_A)
    a = tab(key=KEY_A)
    a.until(f"document.querySelector('#jobs-list li[data-id=\"{vid}\"]')")
    a.page.click(f'#jobs-list li[data-id="{vid}"] button')
    a.wait_completed()
    assert a.js("sessionStorage.getItem('dloserve.apiKey')") == KEY_A and a.js("localStorage.length") == 0
    a.page.reload()  # the key lasts as long as the tab
    a.until(f"document.querySelector('#jobs-list li[data-id=\"{vid}\"]')")
    a.page.click(f'#jobs-list li[data-id="{vid}"] button')
    a.wait_completed()
    a.page.click("#job-remix")  # her prompt in the form, too
    assert a.js("document.getElementById('f-prompt').value") == "alice's secret fox"

    def nothing_of_alice(p: Page) -> None:
        html = p.js("document.documentElement.outerHTML")
        for secret in (vid, "secret fox"):
            at = html.find(secret)
            assert at < 0, html[max(0, at - 300):at + 100]
        assert p.js("[...document.querySelectorAll('#create-form [name]')].every(e => e.value === '')")
        assert p.js("document.querySelectorAll('#jobs-list li').length") == 0
        assert p.js("document.getElementById('job-view').hidden")

    a.use_key("sk-wrong-key")  # the same tab: what the last key saw goes
    a.until("document.getElementById('key-msg').textContent.includes('refused')")
    assert "Incorrect API key" in a.text("#key-msg")
    nothing_of_alice(a)
    b = tab(key=KEY_B)
    b.until("document.getElementById('jobs-msg').textContent !== ''"
            " || document.querySelector('#jobs-list li')")
    assert vid not in b.js("document.documentElement.outerHTML") and "secret fox" not in b.text("body")
    nobody = tab()
    nobody.until("document.getElementById('key-msg').textContent.includes('needs an API key')")
    nothing_of_alice(nobody)


def test_html_and_script_in_a_prompt_are_text(tab: Any) -> None:
    prompt = ('<img src=x onerror="window.__pwned=1;alert(1)"><script>window.__pwned=2;alert(2)</script>'
              '<b id="injected">bold</b> "quoted" & <svg onload="alert(3)"></svg>')
    p = tab(key=KEY_A, bypass_csp=True)  # the rendering itself must keep it inert
    baseline = p.js("document.querySelectorAll('img, svg, script, b').length")
    vid = p.submit(prompt=prompt, seed=5)
    p.wait_completed()
    p.until(f"document.querySelector('#jobs-list li[data-id=\"{vid}\"] .title')")
    assert p.text("#job-prompt") == prompt
    assert p.text(f'#jobs-list li[data-id="{vid}"] .title') == prompt
    p.page.click("#job-remix")
    assert p.js("document.getElementById('f-prompt').value") == prompt
    p.page.wait_for_timeout(500)  # an onerror would have fired by now
    assert p.js("document.querySelectorAll('img, svg, script, b').length") == baseline
    assert p.js("document.getElementById('injected')") is None and p.js("window.__pwned") is None
    assert p.dialogs == []


def test_keyboard_only(tab: Any, service: str) -> None:
    p = tab()
    kb = p.page.keyboard

    def tab_to(element_id: str, limit: int = 40) -> None:
        for _ in range(limit):
            kb.press("Tab")
            if p.js("document.activeElement.id") == element_id:
                return
        raise AssertionError(f"Tab never reached #{element_id}")

    order = []
    for _ in range(16):
        kb.press("Tab")
        order.append(p.js("document.activeElement.id"))
        style = p.js("(() => { const s = getComputedStyle(document.activeElement); "
                     "return [s.outlineStyle, parseFloat(s.outlineWidth)]; })()")
        assert style[0] != "none" and style[1] >= 2, (order[-1], style)  # focus is visible
    assert order == ["skip", "api-key", "key-use", "key-forget", "f-prompt", "f-negative_prompt",
                     "f-width", "f-height", "f-num_frames", "f-fps", "f-num_inference_steps",
                     "f-guidance_scale", "f-seed", "f-cache", "f-priority", "submit"], order
    p.page.focus("body")
    p.js("document.activeElement.blur()")
    tab_to("api-key")
    kb.type(KEY_B)
    kb.press("Enter")
    p.until("document.getElementById('key-msg').textContent.includes('Key set')")
    tab_to("f-prompt")
    kb.type("typed, never clicked")
    tab_to("f-seed")
    kb.type("21")
    tab_to("submit")
    kb.press("Enter")
    p.wait_completed()
    vid = p.current_id()
    assert httpx.get(f"{service}/v1/videos/{vid}", headers=auth(KEY_B)).json()["seed"] == 21
    tab_to("job-remix")
    kb.press("Enter")
    assert p.js("document.activeElement.id") == "f-prompt"
    assert p.js("document.activeElement.value") == "typed, never clicked"


def test_paging_newest_first(tab: Any, service: str) -> None:
    key = KEY_B
    ids = []
    for i in range(3):  # a second apart: the API orders by created_at, whole seconds
        time.sleep(1.05)
        ids.append(httpx.post(f"{service}/v1/videos", json={"prompt": f"page {i}", "num_inference_steps": 1},
                              headers=auth(key)).json()["id"])
    for vid in ids:
        wait_final(service, vid, key)
    p = tab(key=key)
    p.page.select_option("#page-size", "2")

    def shown() -> list[str]:
        return p.js("[...document.querySelectorAll('#jobs-list li')].map(li => li.dataset.id)")

    def api(after: str | None = None) -> dict:
        params = {"limit": 2, "order": "desc", **({"after": after} if after else {})}
        return httpx.get(f"{service}/v1/videos", params=params, headers=auth(key)).json()

    first = api()
    p.until(f"document.querySelectorAll('#jobs-list li').length === 2 && "
            f"document.querySelector('#jobs-list li').dataset.id === {first['data'][0]['id']!r}")
    assert shown() == [v["id"] for v in first["data"]] and first["has_more"]
    assert shown()[0] == ids[-1]  # the newest first
    assert p.js("document.getElementById('page-newer').disabled")
    pages, seen = 1, shown()
    while not p.js("document.getElementById('page-older').disabled"):
        page = api(seen[-1])
        p.page.click("#page-older")
        p.until(f"document.querySelector('#jobs-list li')?.dataset.id === {page['data'][0]['id']!r}")
        assert shown() == [v["id"] for v in page["data"]]
        pages, seen = pages + 1, seen + shown()
    assert set(ids) <= set(seen) and len(seen) == len(set(seen)) and pages >= 2
    for _ in range(pages - 1):
        p.page.click("#page-newer")
    p.until(f"document.querySelector('#jobs-list li')?.dataset.id === {first['data'][0]['id']!r}")
    assert p.text("#page-label") == "page 1"


@pytest.mark.parametrize("width", [390, 1440])
def test_main_views_fit_phone_and_desktop(tab: Any, width: int) -> None:
    """The video, a field error and a refused key, each fully inside the width, as screenshots."""
    p = tab(width=width, key=KEY_A)

    def fits(view: str) -> None:
        assert p.js("document.documentElement.scrollWidth") <= width, view  # nothing runs off the side
        controls = "button, input, textarea, select, a[href], progress, video"
        off = p.js(f"[...document.querySelectorAll({controls!r})]"
                   f".filter(e => e.offsetParent && e.getBoundingClientRect().right > {width} + 1)"
                   ".map(e => e.id || e.tagName)")
        assert off == [], (view, off)
        p.shot(view)

    p.submit(prompt="a paper boat on a rainy street", width=64, height=48, num_frames=9, seed=4)
    p.wait_completed()
    p.until("document.querySelector('#svc-summary dd')")
    p.page.evaluate("""async () => {
        const v = document.getElementById('job-video');
        await v.play();
        while (v.currentTime < 0.3) await new Promise(r => setTimeout(r, 20));
        v.pause();
    }""")
    fits("video")
    p.page.click("#clear-form")
    p.fill(prompt="a 33 pixel wide video", width=33, height=32)
    p.page.click("#submit")
    p.until("document.getElementById('err-width').textContent !== ''")
    fits("error")
    p.use_key("sk-wrong-key")
    p.until("document.getElementById('key-msg').textContent.includes('refused')")
    fits("wrong-key")


BADGES = ("window.__badges = []; setInterval(() => { const t = document.getElementById('state-badge')"
          ".textContent; if (window.__badges.at(-1) !== t) window.__badges.push(t); }, 50)")


def test_the_service_panel_follows_a_rank_death_and_the_rebuild(tab: Any, served: tuple[str, Serve]) -> None:
    url, s = served
    p = tab(key=KEY_A)
    p.until("document.getElementById('state-badge').textContent === 'ready'")
    # A key's own queue and its limit (the default --max-queued-per-key); the totals are the admin's.
    p.until("document.getElementById('svc-summary').textContent.includes('queued (limit 16)')")
    assert "running (all keys)" not in p.text("#svc-summary")
    p.js(BADGES)
    before = httpx.get(f"{url}/readyz", headers=auth(KEY_A)).json()  # rebuilds: a key's view
    ranks = matching(s.proc.pid, "RankActor")
    assert len(ranks) == 2, ranks
    os.kill(ranks[0], signal.SIGKILL)
    p.until("window.__badges.some(b => b.startsWith('rebuilding: rank'))", timeout=60)
    p.until("document.getElementById('state-badge').textContent === 'ready'", timeout=180)
    after = httpx.get(f"{url}/readyz", headers=auth(KEY_A)).json()
    assert after["rebuilds"] == before["rebuilds"] + 1
    p.until(f"document.getElementById('svc-groups').textContent.includes('generation {after['generation']}')")
    assert "rank" in p.text("#svc-groups .err")  # the group's last error: which rank died


def test_the_badge_shows_draining_then_unreachable(tab: Any, drained: tuple[str, Serve]) -> None:
    """SIGTERM to its own instance while a video runs: draining, then unreachable, nothing left."""
    url, s = drained
    p = tab(url=url, key=KEY_A)
    p.js(BADGES)
    p.submit(prompt="a long one, running when the drain starts", width=64, height=48, num_frames=17,
             num_inference_steps=150)
    p.until("document.getElementById('job-progress').value > 0", timeout=120)
    s.seen |= set(descendants(s.proc.pid))
    s.proc.send_signal(signal.SIGTERM)
    p.until("window.__badges.some(b => b.startsWith('draining'))", timeout=30)
    p.until("document.getElementById('state-badge').textContent.startsWith('unreachable')", timeout=120)
    assert s.proc.wait(60) == 0, s.output[-2000:]
    time.sleep(0.5)
    assert not s.survivors(), s.survivors()
