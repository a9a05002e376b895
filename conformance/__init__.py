"""The conformance kit: language-neutral vectors (JSON and binary blobs) a device port must match.

`python -m conformance` checks a port through its adapter (`conformance/port.py`);
`python -m conformance.generate` rewrites the vectors from fixed seeds (docs/how-to/conformance-kit.md).
"""
