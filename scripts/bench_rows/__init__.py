"""The measured sides of ``scripts/bench_peers.py``: one module per row group, each with a
``kiln(params)`` and a ``peer(params)`` function returning a JSON-able dict. The peer modules
import nothing from kiln where the peer is a third-party package (torchtitan, transformers), so
they run in the peer's own environment."""
