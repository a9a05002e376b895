"""The conformance kit: language-neutral vectors (JSON and binary blobs under `vectors/`) that a
port of the device runtime must reproduce, and a runner that checks a port through `port.Port`
(docs/how-to/conformance-kit.md)."""
