"""Benchmarks of cronoq-store against raw asyncpg, COPY and the Python peers.

Run ``python -m benchmarks.run [--quick] [--out DIR]`` from the repository root, in an
environment with ``pip install -e . -r benchmarks/requirements.txt``. Every figure is measured
in the same run as its baselines, on the same server, interleaved and repeated; see
``docs/performance.md`` for the method and the latest figures.
"""
