"""Any trace file, in any format the readers take: a trace (and its synthesis) or a
``HybridCacheError``, never a builtin exception."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.errors import HybridCacheError
from hybridcache.workloads import read_trace
from hybridcache.workloads.synthesis import synthesize

FIELDS = ["timestamp", "input_length", "output_length", "hash_ids", "chat_id", "parent_chat_id", "turn", "type",
          "prompt", "output", "conversation"]
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=6),
    max_leaves=15,
)
PLAUSIBLE = {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}
LINES = st.one_of(
    VALUES.map(json.dumps),
    st.dictionaries(st.sampled_from(FIELDS), VALUES).map(lambda fields: json.dumps({**PLAUSIBLE, **fields})),
    st.binary(max_size=20).map(lambda raw: raw.decode("latin-1")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(LINES, min_size=1, max_size=4), fmt=st.sampled_from(["auto", "mooncake", "bailian", "tokens"]))
def test_any_trace_file_is_read_or_refused_with_a_hybridcache_error(tmp_path, lines, fmt):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    try:
        trace = read_trace(path, fmt)
    except HybridCacheError:
        return  # refused: the only way a bad file may fail
    assert trace.entries and trace.format in ("mooncake", "bailian", "tokens")
    requests = synthesize(trace, seed=0).requests
    assert [request.prompt_length for request in requests] == [entry.input_length for entry in trace.entries]
    assert all(request.tokens.size == entry.input_length + entry.output_length
               for request, entry in zip(requests, trace.entries))
