"""The README's short form of the protocol runs as written."""

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_protocol_example_runs_and_admits():
    text = README.read_text()
    block = text.split("## Using the prefix cache directly")[1].split("```python")[1].split("```")[0]
    scope = {"prompt_tokens": list(range(1, 300)), "print": lambda *args: None}
    exec(compile(block, str(README), "exec"), scope)
    assert scope["admission"].admitted and scope["cache"].trie.nodes.num_attached == 256 // 16  # cached
    scope["cache"].trie.check_invariants()
