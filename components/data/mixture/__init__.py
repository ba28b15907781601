"""Data mixtures: named sources with weights and stages (``dataset``), the pure function of
(seed, weights, position) that picks each sequence's source (``order``), and the loader that
reads a global batch from them (``loader``). docs/data.md "Mixtures and stages"."""
