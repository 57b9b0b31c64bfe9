"""The OpenAI-compatible API in front of Triton servers that serve llmc models (docs/openai.md):
app.py (routes), backends.py (the servers, health-checked, least in flight), protocol.py (requests,
errors), responses.py and streaming.py (bodies and SSE chunks), server.py (uvicorn)."""
