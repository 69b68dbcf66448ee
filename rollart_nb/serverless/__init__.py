"""Serverless pool: HTTP client for endpoints (and Ray Serve deployments)."""

from rollart_nb.serverless.client import Endpoint, acall, call

__all__ = ["Endpoint", "acall", "call"]
