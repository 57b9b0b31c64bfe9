"""Serving benchmarks: builds served by a real Triton server (or the OpenAI frontend before it)."""
