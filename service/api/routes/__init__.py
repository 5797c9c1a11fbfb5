"""The HTTP routes, one module per resource: videos, models, LoRA adapters, and the service's
own state (health, readiness, waves). ``service.api.app`` includes them in this order (the
OpenAPI document lists paths in it)."""
