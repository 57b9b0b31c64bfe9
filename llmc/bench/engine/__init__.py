"""Engine benchmarks: a graph or engine choice on SmolLM2, measured in process (no server)."""
