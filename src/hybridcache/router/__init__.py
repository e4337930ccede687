"""Routing by what a replica can restore: per-replica indexes of announced KV chains and
checkpoints (``replica_index``, fed by ``feed`` from a replica's two event streams), the
routing cost and policies (``policy``), and ``hybridcache router``, the HTTP proxy in front of
OpenAI-compatible replicas (``proxy``). The replay's ``--routing`` uses the same index and
cost. docs/routing.md describes it. Needs the ``events`` extra.
"""
