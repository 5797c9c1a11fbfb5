"""The front door's shape: the OpenAPI document the routes make is the one clients were given.

``openapi-base.json`` is the document before an instance fills in its limits (openapi.py):
paths in their order, parameters, bodies, declared responses. A change to a route shows up
here; when it is meant, write the file again:

    .venv/bin/python -c "import json; from service.api.app import create_app; \\
      open('tests/api/openapi-base.json', 'w').write(json.dumps(create_app().openapi(), indent=1) + '\\n')"
"""

from __future__ import annotations

import json
from pathlib import Path

SNAPSHOT = Path(__file__).resolve().parent / "openapi-base.json"


def test_the_openapi_document_is_the_one_clients_were_given() -> None:
    from service.api.app import create_app

    assert json.dumps(create_app().openapi(), indent=1) + "\n" == SNAPSHOT.read_text()


def test_the_playground_is_not_in_the_document_and_every_route_declares_its_401() -> None:
    from service.api.app import create_app

    spec = create_app().openapi()
    assert not [p for p in spec["paths"] if p.startswith("/ui")]
    for path, methods in spec["paths"].items():
        if path.startswith("/v1/"):
            for method, op in methods.items():
                assert "401" in op["responses"], (method, path)
