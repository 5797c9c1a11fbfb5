"""Two Ray nodes on this machine (``ray.cluster_utils.Cluster``: two raylets, one CPU
each, so each node holds exactly one DP group), two replicas of the service, one job store,
results in an S3 bucket.

In file order: the batch job submitted with ``ray job submit`` runs two DP groups (one per
node); then the service with ``num_replicas=2``: requests land on both replicas (the video
object and the ``x-dloserve-dp-group`` header say which), every job reads, lists, downloads
and deletes the same through either replica, and the bytes equal ``dloserve generate``;
last, the worker node is removed under load: the jobs its replica held run again on the
surviving replica, every job completes, nothing is lost, and the survivor keeps serving.

Run with ``make multinode`` (its own process: this module starts its own cluster; in file order,
``-p no:randomly``: the tests share one cluster, and the last one removes a node).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import wait_ready
from tests.api.test_bytes import FIELDS, generate_cli
from tests.conftest import free_port

pytestmark = pytest.mark.multinode
APP = "dloserve-multinode"
SLOW = {**FIELDS, "num_inference_steps": 24}  # long enough to be in flight when the node goes
KEY_A, KEY_B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
ADMIN = {"authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    import ray
    from ray.cluster_utils import Cluster

    # One proxy (the head's) for the test's one URL; by default a proxy prefers replicas on its
    # own node, so the worker's replica would never be asked (a load balancer in front of
    # every node's proxy spreads requests in production).
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    dash = free_port()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dash,
    })
    worker = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield {"cluster": c, "worker": worker, "dashboard": f"http://127.0.0.1:{dash}",
               "head_id": c.head_node.node_id, "worker_id": worker.node_id}
    finally:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()


def test_batch_job_runs_two_dp_groups_on_two_nodes(cluster: dict, demo_model: str, tmp_path: Path) -> None:
    import ray

    assert ray.available_resources().get("CPU", 0) >= 2, "run this before the service takes the nodes"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"b{i}", "prompt": FIELDS["prompt"], "width": 96,
                                           "height": 64, "num_frames": 9, "num_inference_steps": 3,
                                           "seed": 0}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    cmd = ["ray", "job", "submit", "--address", cluster["dashboard"], "--", sys.executable, "-m",
           "service.jobs.batch", "--prompts", str(prompts), "--out", str(out), "--model", demo_model,
           "--num-groups", "2", "--cpus-per-rank", "1", "--encoders-per-rank", "0"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    end = time.monotonic() + 300
    while True:  # the dashboard's job agent may not be up yet: Ray says so and asks to try again
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if "No available agent to submit job" not in done.stdout + done.stderr or time.monotonic() > end:
            break
        time.sleep(3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    entries = [json.loads(ln) for ln in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == [f"b{i}" for i in range(6)]
    assert all(e["status"] == "completed" for e in entries), entries
    assert {e["node_id"] for e in entries} == {cluster["head_id"], cluster["worker_id"]}, entries
    want = generate_cli(demo_model, tmp_path / "cli.mp4")
    assert all((out / e["file"]).read_bytes() == want for e in entries)


@pytest.fixture(scope="module")
def served(cluster: dict, demo_model: str, s3_server: dict) -> Iterator[str]:
    """Results in an S3 bucket (moto's S3 server here): no replica shares a folder with another."""
    from ray import serve

    from service.api.app import deploy
    from service.api.service import ServiceConfig

    keys = [hashlib.sha256(k.encode()).hexdigest() for k in ("key-a", "key-b")]
    admin = [hashlib.sha256(b"admin-key").hexdigest()]
    # the same start path as `dloserve serve` (deploy: serve.start, serve.run; each replica's
    # ranks in its placement group), standbys on (they hold no CPU: each node's one is the rank's)
    cfg = ServiceConfig(model=demo_model, api_key_hashes=keys, admin_key_hashes=admin, data_parallel_size=1,
                        cpus_per_rank=1, num_replicas=2, rank_standby=True,
                        results_url=f"s3://{s3_server['bucket']}/multinode",
                        storage_options=s3_server["storage_options"], group_timeout_s=5,
                        pg_timeout_s=60, wave_deadline_base_s=120, wave_deadline_per_forward_s=1.0)
    port = free_port()
    deploy(cfg, "127.0.0.1", port, name=APP, proxy_location="HeadOnly")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 300)
    end = time.monotonic() + 300
    while running_replicas() < 2:  # /readyz answers once the first replica is up
        assert time.monotonic() < end, serve.status()
        time.sleep(0.5)
    wait_ready(url, 300)
    yield url
    serve.delete(APP)


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in app.deployments.values())


def get(url: str, path: str) -> httpx.Response:
    """A read that retries while the proxy still routes to a replica that just died."""
    for _ in range(50):
        try:
            r = httpx.get(f"{url}{path}", timeout=30, headers=KEY_A)
            if r.status_code < 500:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"GET {path}: no answer below 500")


def by_each_replica(url: str, path: str, groups: set[str], key: dict = KEY_A) -> dict[str, httpx.Response]:
    """The same GET until every replica in ``groups`` has answered it once."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(200):
        r = httpx.get(f"{url}{path}", timeout=30, headers=key)
        g = r.headers.get("x-dloserve-dp-group")
        assert g in groups, (r.status_code, r.headers, r.text[:300])
        seen.setdefault(g, r)
        if set(seen) == groups:
            return seen
    raise AssertionError(f"{path}: answered only by {set(seen)} of {groups}")


def submit(url: str, body: dict, n: int) -> list[str]:
    """``n`` accepted jobs (the proxy spreads them over the replicas)."""
    ids = []
    for _ in range(n):
        r = httpx.post(f"{url}/v1/videos", json=body, timeout=30, headers=KEY_A)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    return ids


def nodes(s3_server: dict, ids: list[str]) -> dict[str, str | None]:
    """Each job's Ray node, read from the job store (what every replica reads its records
    from): the video object tells it to admin callers only, and these are API keys."""
    import ray

    from service.api.jobs import NAMESPACE, store_name

    store = ray.get_actor(store_name(f"s3://{s3_server['bucket']}/multinode"), namespace=NAMESPACE)
    recs = ray.get([store.get.remote(vid) for vid in ids])
    return {vid: rec.node_id if rec is not None else None for vid, rec in zip(ids, recs, strict=True)}


def wait_all_final(url: str, ids: list[str], timeout: float = 300) -> dict[str, dict]:
    end, final = time.monotonic() + timeout, {}
    while time.monotonic() < end and len(final) < len(ids):
        for vid in ids:
            if vid not in final:
                v = get(url, f"/v1/videos/{vid}").json()
                if v["status"] in ("completed", "failed"):
                    final[vid] = v
        time.sleep(0.2)
    assert len(final) == len(ids), f"not final after {timeout}s: {set(ids) - set(final)}"
    return final


def test_jobs_are_the_same_through_every_replica(served: str, cluster: dict, demo_model: str,
                                                 tmp_path: Path, s3_server: dict) -> None:
    url = served
    ids = submit(url, FIELDS, 8)
    final = wait_all_final(url, ids)
    assert all(v["status"] == "completed" for v in final.values()), final
    groups = {v["dp_group"] for v in final.values()}
    assert len(groups) == 2, f"all requests ran on one replica: {groups}"
    assert all(v["node_id"] is None for v in final.values())  # not an API key's business
    assert set(nodes(s3_server, ids).values()) == {cluster["head_id"], cluster["worker_id"]}
    want = generate_cli(demo_model, tmp_path / "cli.mp4")
    for vid in ids:
        reads = by_each_replica(url, f"/v1/videos/{vid}", groups)
        assert len({json.dumps(r.json(), sort_keys=True) for r in reads.values()}) == 1
        for r in by_each_replica(url, f"/v1/videos/{vid}/content", groups).values():
            assert r.status_code == 200 and r.content == want, vid
    for r in by_each_replica(url, "/v1/videos?limit=100&order=asc", groups).values():
        assert set(ids) <= {v["id"] for v in r.json()["data"]}
    # another key sees none of them, through any replica
    for r in by_each_replica(url, f"/v1/videos/{ids[0]}", groups, key=KEY_B).values():
        assert r.status_code == 404
    for r in by_each_replica(url, "/v1/videos?limit=100", groups, key=KEY_B).values():
        assert not set(ids) & {v["id"] for v in r.json()["data"]}
    # delete through one replica; every replica then answers 404
    for vid in ids[:4]:
        assert httpx.delete(f"{url}/v1/videos/{vid}", timeout=30, headers=KEY_B).status_code == 404
        assert httpx.delete(f"{url}/v1/videos/{vid}", timeout=30, headers=KEY_A).status_code == 200
        for r in by_each_replica(url, f"/v1/videos/{vid}", groups).values():
            assert r.status_code == 404


def each_replicas_readyz(url: str, done: Callable[[dict], bool], timeout: float = 300) -> dict[str, dict]:
    """The admin /readyz of each of the two replicas, once ``done`` holds for both."""
    seen: dict[str, dict] = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = httpx.get(f"{url}/readyz", timeout=30, headers=ADMIN)
        seen[r.headers["x-dloserve-dp-group"]] = r.json()
        if len(seen) == 2 and all(done(b) for b in seen.values()):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {seen}")


def test_each_replica_has_its_standby_and_a_killed_rank_comes_back_as_it(served: str, cluster: dict) -> None:
    """Each replica's rank has a standby on its node, loaded ahead; the worker node's rank,
    SIGKILLed, is replaced by that standby's process and its replica serves again."""
    def loaded(body: dict) -> bool:
        return bool(body.get("standbys_loaded")) and all(body["standbys_loaded"].values())

    ready = each_replicas_readyz(served, loaded)
    assert {b["node_id"] for b in ready.values()} == {cluster["head_id"], cluster["worker_id"]}
    worker = next(b for b in ready.values() if b["node_id"] == cluster["worker_id"])
    (group,) = worker["groups"]
    assert worker["standbys"][group["group"]] == [f"dloserve-{group['group']}-gen0-rank0-standby"]
    os.kill(group["last_start"]["pids"][0], signal.SIGKILL)

    def rebuilt(body: dict) -> bool:
        return body["node_id"] != cluster["worker_id"] or (
            body["ready"] and body["groups"][0]["generation"] == 1)

    after = each_replicas_readyz(served, rebuilt)
    again = next(b for b in after.values() if b["node_id"] == cluster["worker_id"])["groups"][0]["last_start"]
    assert again["standby"] is True, again
    vid = submit(served, FIELDS, 1)[0]
    assert wait_all_final(served, [vid])[vid]["status"] == "completed"


def test_a_lost_nodes_jobs_run_again_on_the_other_replica(served: str, cluster: dict,
                                                          s3_server: dict) -> None:
    url = served
    ids = submit(url, SLOW, 8)
    # wait until the worker node's group is generating, then take the node away
    end = time.monotonic() + 120
    while True:
        recs = [get(url, f"/v1/videos/{vid}").json() for vid in ids]
        # a job's node is set with its DP group when it is accepted; both change only when a
        # lost group's jobs are taken over, so the two reads agree
        on = nodes(s3_server, ids)
        lost = {v["dp_group"] for v in recs if on[v["id"]] == cluster["worker_id"]}
        if any(v["status"] == "in_progress" and on[v["id"]] == cluster["worker_id"] for v in recs):
            break
        assert time.monotonic() < end, recs
        time.sleep(0.2)
    assert len(lost) == 1
    done_before = {v["id"] for v in recs if v["status"] == "completed"}
    cluster["cluster"].remove_node(cluster["worker"], allow_graceful=False)
    final = wait_all_final(url, ids, timeout=600)
    assert all(v["status"] == "completed" for v in final.values()), \
        {vid: (v["status"], v.get("error")) for vid, v in final.items() if v["status"] != "completed"}
    on = nodes(s3_server, ids)
    moved = [v for vid, v in final.items() if vid not in done_before and on[vid] == cluster["head_id"]
             and any(vid == r["id"] and r["dp_group"] in lost for r in recs)]
    assert moved, "the lost node held no unfinished job"
    assert all(v["dp_group"] not in lost for v in moved)
    import ray

    from service.api.jobs import NAMESPACE, store_name

    store = ray.get_actor(store_name(f"s3://{s3_server['bucket']}/multinode"), namespace=NAMESPACE)
    lost_report = ray.get(store.status.remote())["groups_lost"]
    assert [(g["dp_group"], g["node_id"], g["failed"]) for g in lost_report] == \
        [(next(iter(lost)), cluster["worker_id"], 0)], lost_report
    assert lost_report[0]["run_again"] >= len(moved), lost_report
    # the surviving replica keeps serving
    for _ in range(50):
        r = httpx.post(f"{url}/v1/videos", json=FIELDS, timeout=30, headers=KEY_A)
        if r.status_code == 202:
            break
        time.sleep(0.2)
    assert r.status_code == 202, r.text
    after = wait_all_final(url, [r.json()["id"]])
    assert next(iter(after.values()))["status"] == "completed"
    print(f"\nmulti-node: {len(ids)} jobs, node {cluster['worker_id'][:8]} removed, "
          f"{len(moved)} of its group's jobs ran again on the other replica, all completed, lost 0")
