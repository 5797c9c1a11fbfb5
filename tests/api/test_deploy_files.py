"""deploy/ files stay valid: the Serve config builds our app, dashboards name real metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_serve_config_validates_and_builds_the_app() -> None:
    from ray.serve.schema import ServeDeploySchema

    from service.api.app import build_app
    from service.api.service import ServiceConfig

    raw = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)
    app = schema.applications[0]
    assert app.import_path == "service.api.app:build_app"
    ServiceConfig(**app.args)  # every key is a real setting
    assert build_app(app.args) is not None


def test_dashboard_and_scrape_config_name_only_exported_metrics() -> None:
    from service.engine.metrics import metrics

    exported = {"ray_" + m._name for m in metrics().values()}  # Ray adds the ray_ prefix
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"ray_dloserve_\w+", e)}
    assert used == exported, (used - exported, exported - used)  # no typos, nothing left out
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert prom["rule_files"] == ["alerts.yml"]


def test_dashboard_json_is_what_the_generator_writes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboard", DEPLOY / "dashboard.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DEPLOY / "grafana-dashboard.json").read_text() == gen.render(), "run: python deploy/dashboard.py"


@pytest.mark.deploy  # needs promtool: `make setup-system` installs Debian's prometheus package
def test_alert_rules_check_and_pass_their_unit_tests() -> None:
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make setup-system` installs Debian's prometheus package"
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run([promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
