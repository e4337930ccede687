"""``hybridcache demo``: a multi-turn chat served by the reference engine, with and without
prefix caching.

Sixteen conversations share a system prompt; every turn sends the whole conversation so far
(history, the assistant's previous reply, a new user message) and generates a reply. The same
workload runs twice, with prefix caching off and on; the table compares, per turn and overall,
prompt tokens, tokens served from the cache, the hit rate, the prefill tokens actually computed
and the wall time, and the demo checks that every output is identical.

By default the model is the tiny hybrid model and the turns are random token ids. With
``model_dir`` (``hybridcache demo --model DIR``) a local transformers checkpoint serves them:
where DIR holds a tokenizer with a chat template, the turns are English text rendered through
that template and a sample reply is printed; otherwise they are random ids from its vocabulary.

Owns nothing between runs: each run builds its engines and its conversations' histories.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from hybridcache.cli_args import compact_table
from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig
from hybridcache.engine.hf import HFModelConfig

CONVERSATIONS = 16
TURNS = 6
SYSTEM_PROMPT_TOKENS = 64
USER_TOKENS = (8, 24)
REPLY_TOKENS = 8
# A checkpoint's KV is far larger per token than the tiny model's: 512 blocks (8192 tokens) hold
# the workload's longest turns for every running conversation at once.
CHECKPOINT_KV_BLOCKS = 512

SYSTEM_TEXT = (
    "You are a concise assistant for a team that runs a language model service. Answer in one "
    "or two short sentences and keep to what was said in earlier turns."
)
TOPICS = (
    "prefix caching", "paged attention", "state space models", "mixture of experts", "chunked prefill",
    "speculative decoding", "quantization", "batch scheduling", "preemption", "eviction policies",
    "rotary embeddings", "sliding windows", "KV compression", "checkpointing recurrent state",
    "multi-turn chat", "load balancing",
)
QUESTIONS = (
    "Explain {topic} in one sentence.",
    "Why does {topic} matter for long conversations?",
    "What is a common mistake with {topic}?",
    "How would you measure whether {topic} works?",
    "Give one case where {topic} does not help.",
    "Summarize what we said about {topic}.",
)


@dataclass
class TurnReport:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


def engine_config(prefix_caching: bool, model: HFModelConfig | None = None) -> EngineConfig:
    return EngineConfig(
        block_size=16,
        num_kv_blocks=2048 if model is None else CHECKPOINT_KV_BLOCKS,
        num_state_slots=96,
        checkpoint_budget=64,
        prefix_caching=prefix_caching,
        max_batch_tokens=512,
        max_running=16,
        prefill_chunk=64,
        model=TinyHybridConfig() if model is None else model,
    )


def user_messages(seed: int, vocab_size: int = 512) -> list[list[list[int]]]:
    """user_messages[turn][conversation]: the new user tokens of each turn."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, vocab_size, int(rng.integers(*USER_TOKENS))).tolist() for _ in range(CONVERSATIONS)]
        for _ in range(TURNS)
    ]


class Turns(Protocol):
    """One run's conversations: each turn's prompts, then the replies that extend them."""

    def prompts(self, turn: int) -> list[list[int]]: ...

    def record(self, prompts: list[list[int]], replies: list[list[int]]) -> None: ...


class TokenTurns:
    """Random token ids. Owns each conversation's token history."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        system = rng.integers(0, vocab_size, SYSTEM_PROMPT_TOKENS).tolist()
        self._users = user_messages(seed + 1, vocab_size)
        self._histories = [list(system) for _ in range(CONVERSATIONS)]

    def prompts(self, turn: int) -> list[list[int]]:
        return [history + users for history, users in zip(self._histories, self._users[turn])]

    def record(self, prompts: list[list[int]], replies: list[list[int]]) -> None:
        self._histories = [prompt + reply for prompt, reply in zip(prompts, replies)]


class ChatTurns:
    """Text turns through a chat template. Owns each conversation's messages; a reply goes
    back into the conversation as the decoded text, as a chat client would send it."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._conversations = [[{"role": "system", "content": SYSTEM_TEXT}] for _ in range(CONVERSATIONS)]
        self._asked: list[dict[str, str]] = []

    def prompts(self, turn: int) -> list[list[int]]:
        self._asked = [
            {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)].format(topic=TOPICS[c % len(TOPICS)])}
            for c in range(CONVERSATIONS)
        ]
        return [self._tokenizer.prompt_ids(messages + [asked]) for messages, asked in zip(self._conversations, self._asked)]

    def record(self, prompts: list[list[int]], replies: list[list[int]]) -> None:
        for messages, asked, reply in zip(self._conversations, self._asked, replies):
            messages += [asked, {"role": "assistant", "content": self._tokenizer.text(reply)}]

    def sample(self) -> tuple[str, str]:
        """The first conversation's last question and reply."""
        *_, question, reply = self._conversations[0]
        return question["content"], reply["content"]


def serve(config: EngineConfig, make_turns: Callable[[int], Turns], advance) -> tuple[list[TurnReport], Turns]:
    """One run; ``make_turns`` builds its conversations from the model's vocabulary size."""
    engine = Engine(config)
    turns = make_turns(engine.model.layout.vocab_size)
    reports = []
    for turn in range(TURNS):
        prompts = turns.prompts(turn)
        requests = [Request(prompt=prompt, max_new_tokens=REPLY_TOKENS) for prompt in prompts]
        computed_before = engine.stats()["computed_tokens"]
        started = time.perf_counter()
        results = engine.generate(requests)
        report = TurnReport(seconds=time.perf_counter() - started)
        report.computed_tokens = engine.stats()["computed_tokens"] - computed_before
        for request, result in zip(requests, results):
            report.prompt_tokens += len(request.prompt)
            report.cached_tokens += result.cached_tokens
            report.outputs.append(result.tokens)
        turns.record(prompts, report.outputs)
        reports.append(report)
        advance()
    engine.check_invariants()
    return reports, turns


def run_demo(console: Console, errors: Console, seed: int = 0, model_dir: str | None = None, dtype: str = "float32") -> bool:
    """Serve the workload with caching off, then on; True when every output is identical.
    Results go to ``console``, the progress bar to ``errors`` (stderr)."""
    model = None if model_dir is None else HFModelConfig(model_dir, dtype)
    make_turns = _turns_factory(model_dir, seed)
    runs = []
    with Progress(console=errors, transient=True) as progress:
        task = progress.add_task(f"serving {CONVERSATIONS} conversations x {TURNS} turns, caching off then on", total=2 * TURNS)
        for caching in (False, True):
            runs.append(serve(engine_config(caching, model), make_turns, lambda: progress.advance(task)))
    (uncached, _), (cached, cached_turns) = runs
    identical = all(a.outputs == b.outputs for a, b in zip(uncached, cached))
    console.print(_table(uncached, cached, "the tiny hybrid model" if model_dir is None else str(model_dir)))
    later = cached[1:]
    later_rate = sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later))
    reference, _ = serve(replace(engine_config(True, model), checkpoint_policy="reference"), make_turns, lambda: None)
    reference_rate = sum(r.cached_tokens for r in reference[1:]) / max(1, sum(r.prompt_tokens for r in reference[1:]))
    policy = engine_config(True, model).checkpoint_policy
    console.print(f"hit rate for turns 2-{TURNS}: {later_rate:.1%} (checkpoint policy {policy}; the reference rule: {reference_rate:.1%})")
    text = isinstance(cached_turns, ChatTurns)
    console.print(f"turns: {'text through the checkpoint' + chr(39) + 's chat template' if text else 'random token ids'}")
    if text:
        question, reply = cached_turns.sample()
        console.print(f"sample reply (conversation 1, turn {TURNS}):")
        console.print(f"  user: {escape(question)}\n  assistant: {escape(reply)}")
    verdict = "[bold green]identical[/]" if identical else "[bold red]DIFFERENT[/]"
    console.print(f"outputs with and without prefix caching: {verdict}")
    return identical


def _turns_factory(model_dir: str | None, seed: int) -> Callable[[int], Turns]:
    """Text turns where the checkpoint has a chat template, random token ids otherwise."""
    tokenizer = None
    if model_dir is not None:
        from hybridcache.engine.hf.chat import load_chat_tokenizer  # imports transformers

        tokenizer = load_chat_tokenizer(model_dir)
    if tokenizer is not None:
        return lambda _vocab_size: ChatTurns(tokenizer)
    return lambda vocab_size: TokenTurns(vocab_size, seed)


def _table(uncached: list[TurnReport], cached: list[TurnReport], model_name: str) -> Table:
    columns = ["turn", "prompt tokens", "from cache", "hit rate", "computed off", "computed on", "time off s", "time on s"]
    table = compact_table(f"multi-turn chat on {escape(model_name)}: prefix caching off vs on", columns)
    for turn, (off, on) in enumerate(zip(uncached, cached), start=1):
        table.add_row(*_row(str(turn), [off], [on]))
    table.add_section()
    table.add_row(*_row("overall", uncached, cached), style="bold")
    return table


def _row(label: str, off: list[TurnReport], on: list[TurnReport]) -> list[str]:
    prompt = sum(r.prompt_tokens for r in on)
    hit = sum(r.cached_tokens for r in on)
    return [
        label,
        str(prompt),
        str(hit),
        f"{hit / prompt:.1%}",
        str(sum(r.computed_tokens for r in off)),
        str(sum(r.computed_tokens for r in on)),
        f"{sum(r.seconds for r in off):.2f}",
        f"{sum(r.seconds for r in on):.2f}",
    ]
