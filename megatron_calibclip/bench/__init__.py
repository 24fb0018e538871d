"""Benchmarks behind `calibclip bench ...`; each prints one JSON object (ratios measured side
by side in one run, so they can be compared across machines)."""
