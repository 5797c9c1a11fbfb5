"""Host and Origin checks (service/api/origin.py), and what a browser may load: over real
HTTP on the shared open app (bound to 127.0.0.1, so it answers loopback names only)."""

from __future__ import annotations

import httpx

from service.api.origin import LOOPBACK_HOSTS, hostname, refusal


def test_hostname_reads_every_form_of_the_host_header() -> None:
    assert [hostname(h) for h in ("127.0.0.1:8000", "[::1]:8000", "LocalHost.:80", "::1", "evil.example")] \
        == ["127.0.0.1", "::1", "localhost", "::1", "evil.example"]


def test_a_proxys_forwarded_host_names_the_origin_and_reads_never_need_one() -> None:
    hosts = list(LOOPBACK_HOSTS)
    proxied = {"host": "127.0.0.1:8000", "origin": "https://video.example",
               "x-forwarded-host": "video.example"}
    assert refusal("POST", proxied, []) is None
    assert refusal("GET", {"host": "127.0.0.1:8000", "origin": "https://evil.example"}, hosts) is None
    assert refusal("DELETE", {"host": "127.0.0.1:8000", "origin": "null"}, hosts)[0] == "cross_origin"


def test_a_rebound_name_is_refused_on_a_loopback_bind(app_url: str) -> None:
    for method, path in (("GET", "/v1/videos"), ("POST", "/v1/videos"), ("GET", "/healthz")):
        r = httpx.request(method, f"{app_url}{path}", headers={"Host": "evil.example"}, json={"prompt": "x"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host", r.text
        assert r.json()["error"]["param"] == "host" and r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{app_url.replace('127.0.0.1', 'localhost')}/healthz").status_code == 200


def test_a_cross_site_write_is_refused_and_the_own_origin_taken(app_url: str) -> None:
    before = len(httpx.get(f"{app_url}/v1/videos", params={"limit": 100}).json()["data"])
    evil = {"Origin": "http://evil.example"}
    r = httpx.post(f"{app_url}/v1/videos", headers=evil, data={"prompt": "a cross-site form"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin", r.text
    r = httpx.post(f"{app_url}/v1/loras", headers={**evil, "Content-Type": "text/plain"},
                   content=b'{"name": "x", "source": "/tmp/x.safetensors"}')
    assert r.status_code == 403, r.text
    assert httpx.delete(f"{app_url}/v1/videos/video_x", headers=evil).status_code == 403
    assert len(httpx.get(f"{app_url}/v1/videos", params={"limit": 100}).json()["data"]) == before
    own = {"Origin": app_url}  # the /ui page's own requests
    r = httpx.post(f"{app_url}/v1/videos", headers=own, json={"prompt": ""})
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt", r.text  # past the check


def test_adapter_registration_takes_json_only(app_url: str) -> None:
    r = httpx.post(f"{app_url}/v1/loras", headers={"Content-Type": "text/plain"},
                   content=b'{"name": "x", "source": "/tmp/x.safetensors"}')
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text


def test_no_cdn_docs_pages_and_html_carries_the_page_headers(app_url: str) -> None:
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(f"{app_url}{path}").status_code == 404
    page = httpx.get(f"{app_url}/ui/")
    assert page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert httpx.get(f"{app_url}/openapi.json").status_code == 200
