"""The API's routers: jobs, validate, health."""

from cortex_api.routes import health, jobs, validate

__all__ = ["health", "jobs", "validate"]
