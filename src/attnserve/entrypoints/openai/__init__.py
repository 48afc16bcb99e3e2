"""The OpenAI-compatible server (``attnserve serve``).

``api_server`` (FastAPI app, errors, API key, uvicorn), ``protocol`` (pydantic wire models),
``serving_completion`` and ``serving_chat`` (one endpoint each), ``metrics`` (Prometheus text).
Importing this package imports nothing of FastAPI; import ``api_server`` for the app.
"""

from __future__ import annotations

__all__: list[str] = []
