"""Event streams: vLLM-compatible KV events and hybridcache's checkpoint events.

Owns nothing itself; its modules own the schema (``schema``), content hashes (``hashing``),
the configuration (``config``), a stream's publisher with its replay buffer (``publisher``),
a stream's subscriber (``subscriber``) and the indexes a consumer builds (``index``).
Needs the ``events`` extra (pyzmq, msgspec). docs/events.md describes the wire.
"""
