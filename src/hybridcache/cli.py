"""Command line: ``hybridcache demo``, ``bench <scenario>``, ``serve``, ``replay`` and ``router``.

Owns the two consoles: results (tables) go to stdout, progress bars and errors to stderr; both
follow the terminal's width (or ``COLUMNS``). Every option is checked as it is parsed
(``hybridcache.cli_args``); an error is one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape

from hybridcache import cli_args
from hybridcache.errors import HybridCacheError

console = Console()
errors = Console(stderr=True)
SCENARIO_NAMES = (
    "match", "match-partial", "kv-match", "admit-many", "miss", "rollback", "rematch", "publish", "evict", "memory",
    "soak-engine", "router", "lmdeploy-schedule", "serve", "routing", "unit-costs", "admission-stages",
)


MAX_BENCH_BATCH = 2**20
MAX_BENCH_CONTEXT = 2**24


def _failed(command: str, error: BaseException) -> int:
    """Say why on stderr, one line, no traceback; exit status 2."""
    message = f"hybridcache {command}: error: {type(error).__name__}: {escape(str(error))}"
    errors.print(message, style="red", highlight=False, soft_wrap=True)
    return 2


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from hybridcache.bench.method import ensure_controlled_process, pin_to_one_cpu

    if args.scenario == "serve":  # a server and its clients: several processes, not one pinned CPU
        return _serve_bench(args)
    if args.scenario == "routing":  # replicas, a router and clients: several processes too
        return _routing_bench(args)
    ensure_controlled_process(argv)
    cpu = pin_to_one_cpu()
    try:
        if args.scenario == "router":
            return _bench_router(args)
        if args.scenario in ("unit-costs", "admission-stages"):
            return _bench_floor(args)
        return _soak_engine(args) if args.scenario == "soak-engine" else _bench_scenarios(args, cpu)
    except (HybridCacheError, OSError) as error:  # OSError: an output that could not be written
        return _failed("bench", error)


def _bench_scenarios(args: argparse.Namespace, cpu: int | None) -> int:
    from hybridcache.bench import cli_support

    if args.compare:  # the reference must be importable before anything runs
        from hybridcache.bench.lmdeploy_impl import load_lmdeploy

        try:
            load_lmdeploy()
        except RuntimeError as error:  # its message is the set-up hint
            return _failed("bench", error)
    impls = ["hybridcache"] + ([args.compare] if args.compare else [])
    scenarios = cli_support.ALL_SCENARIOS if args.scenario == "all" else (args.scenario,)
    records = []
    for scenario in scenarios:
        cases = cli_support.cases_for(scenario, args.batch, args.context, args.steps, args.block_size, args.smoke)
        records.extend(cli_support.run_scenario(scenario, impls, cases, errors))
    records = cli_support.with_ratios(records)
    cli_support.print_records(records, console, cpu)
    if args.json:
        cli_support.write_json(records, args.json)
        errors.print(f"wrote {escape(args.json)}", highlight=False)
    if args.plot:
        cli_support.plot(records, args.plot)
        errors.print(f"wrote {escape(args.plot)}", highlight=False)
    return 0


def _soak_engine(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from hybridcache.bench.cli_support import write_json
    from hybridcache.bench.soak_engine import run_soak_engine

    total = 200 if args.smoke else args.requests
    with Progress(console=errors, transient=True) as progress:
        task = progress.add_task("soak-engine", total=total)
        record = run_soak_engine(total, progress=lambda: progress.advance(task))
    table = cli_args.compact_table("hybridcache bench soak-engine", ["measure", "value"], left=("measure",))
    for key, value in record.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if args.json:
        write_json([record], args.json)
    return 0 if record["leaked_pool_entries"] == 0 and record["exact_samples"].split("/")[0] == record["exact_samples"].split("/")[1] else 1


def _bench_floor(args: argparse.Namespace) -> int:
    from hybridcache.bench import cli_support

    records = cli_support.run_floor_report(args.scenario, args.batch, args.context, args.block_size, args.smoke, console)
    if args.json:
        cli_support.write_json(records, args.json)
    return 0


def _bench_router(args: argparse.Namespace) -> int:
    from hybridcache.bench.cli_support import write_json
    from hybridcache.bench.router import run_router_bench

    record = run_router_bench(blocks=2_000, requests=100) if args.smoke else run_router_bench(requests=min(args.requests, 100_000))
    table = cli_args.compact_table("hybridcache bench router (scoring per request)", ["measure", "value"], left=("measure",))
    for key, value in record.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if args.json:
        write_json([record], args.json)
    return 0


def _router(args: argparse.Namespace, _: list[str]) -> int:
    from hybridcache.router.fleet import Fleet
    from hybridcache.router.policy import check_policy
    from hybridcache.router.proxy import RouterServer

    try:
        fleet = Fleet(args.replica, check_policy(args.policy), health_interval_s=args.health_interval,
                      load_tokens=args.load_tokens)
        timeouts = {"timeout_s": args.upstream_timeout, "client_timeout_s": args.client_timeout}
        server = RouterServer(fleet, args.host, args.port, max_connections=args.max_connections,
                              **{k: v for k, v in timeouts.items() if v is not None})
    except (HybridCacheError, OSError) as error:  # a bad policy, a port taken: say why, no traceback
        return _failed("router", error)
    errors.print(f"hybridcache router on {server.url} ({args.policy}) over {', '.join(args.replica)}", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _serve_bench(args: argparse.Namespace) -> int:
    from hybridcache.bench.cli_support import write_json
    from hybridcache.bench.serve import ServeBench, run_serve_bench

    if args.smoke:
        bench = ServeBench(clients=2, turns=2, system_tokens=96, opening_tokens=32, user_tokens=16, reply_tokens=4, model="tiny")
    else:
        bench = ServeBench(clients=args.clients, turns=args.turns, system_tokens=args.system_tokens or ServeBench.system_tokens,
                           model=args.model,
                           duration_s=args.duration or 0.0)
    try:
        records = run_serve_bench(bench)
    except (HybridCacheError, OSError, RuntimeError) as error:  # RuntimeError: a server that did not start
        return _failed("bench", error)
    columns = ["caching", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "generated_tokens_per_s", "token_hit_rate",
               "server_rss_before_mb", "server_rss_after_mb"]
    table = cli_args.compact_table(f"hybridcache bench serve ({bench.clients} clients, {bench.turns} turns)", columns)
    for record in records:
        table.add_row(*(f"{record[c]:.3f}" if isinstance(record[c], float) else str(record[c]) for c in columns))
    console.print(table)
    if "ttft_p50_vs_off" in records[0]:
        console.print(f"TTFT p50, caching on / off: {records[0]['ttft_p50_vs_off']:.3f}")
    for record in records:
        console.print(f"caching {'on' if record['caching'] else 'off'}: {record['server_audit']}", highlight=False)
    if args.json:
        write_json(records, args.json)
    clean = all(record["errors"] == 0 and "holds" in record["server_audit"] for record in records)
    return 0 if clean else 1


def _routing_bench(args: argparse.Namespace) -> int:
    from hybridcache.bench.cli_support import write_json
    from hybridcache.bench.routing import RoutingBench, run_routing_bench

    if args.smoke:
        bench = RoutingBench(replicas=2, clients=2, conversations=2, turns=2, system_tokens=64)
    else:
        bench = RoutingBench(clients=args.clients, turns=args.turns, conversations=args.conversations,
                             system_tokens=args.system_tokens or RoutingBench.system_tokens,
                             num_state_slots=args.state_slots, checkpoint_budget=max(1, args.state_slots // 2),
                             load_tokens=args.load_tokens, system_prompts=args.system_prompts,
                             user_tokens=args.user_tokens, checkpoint_policy=args.checkpoint_policy)
    try:
        records = run_routing_bench(bench)
    except (HybridCacheError, OSError, RuntimeError) as error:  # RuntimeError: a process that did not start
        return _failed("bench", error)
    columns = ["policy", "requests", "errors", "token_hit_rate", "hit_depth_mean", "ttft_p50_s", "ttft_p99_s",
               "predictions", "headroom", "restorable_over_this"]
    title = f"hybridcache bench routing ({bench.replicas} replicas, {bench.conversations} conversations x {bench.turns} turns)"
    table = cli_args.compact_table(title, columns)
    for record in records:
        table.add_row(*(f"{record[c]:.3f}" if isinstance(record[c], float) else str(record[c]) for c in columns))
    console.print(table)
    if args.json:
        write_json(records, args.json)
    return 0 if all(record["errors"] == 0 for record in records) else 1


def _demo(args: argparse.Namespace, _: list[str]) -> int:
    from hybridcache.demo import run_demo

    try:
        return 0 if run_demo(console, errors, model_dir=args.model, dtype=args.dtype) else 1
    except HybridCacheError as error:  # a checkpoint that cannot be served: say why, no traceback
        return _failed("demo", error)


def _serve(args: argparse.Namespace, _: list[str]) -> int:
    from hybridcache.serving.config import ServeConfig
    from hybridcache.serving.server import serve

    try:
        serve(ServeConfig.from_args(args), args.log_level)
    except HybridCacheError as error:
        return _failed("serve", error)
    return 0


def _replay(args: argparse.Namespace, _: list[str]) -> int:
    from hybridcache.replay.cli import run

    return run(args, console, errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay a multi-turn workload through the prefix cache")
    demo.add_argument("--model", metavar="DIR", help="a local transformers checkpoint (default: the tiny hybrid model)")
    demo.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the checkpoint's dtype")
    demo.set_defaults(handler=_demo)
    bench = commands.add_parser("bench", help="run a benchmark scenario")
    bench.add_argument("scenario", choices=[*SCENARIO_NAMES, "all"])
    bench.add_argument("--batch", type=cli_args.int_list(1, MAX_BENCH_BATCH), help="comma-separated batch sizes (default: 128,512)")
    bench.add_argument("--context", type=cli_args.int_list(1, MAX_BENCH_CONTEXT),
                       help="comma-separated prompt lengths (default: 65536,131072)")
    bench.add_argument("--steps", type=cli_args.int_list(1, MAX_BENCH_CONTEXT), help="published steps for miss (default: 1,64,1024)")
    bench.add_argument("--block-size", type=cli_args.int_in(2, 2**16, even=True), default=64,
                       help="block size in tokens, even (default: 64)")
    bench.add_argument("--compare", choices=["lmdeploy"], help="also run the reference implementation")
    bench.add_argument("--plot", type=cli_args.plot_path, metavar="PATH.png", help="write a p50/p99 chart")
    bench.add_argument("--requests", type=cli_args.int_in(1, 10**8), default=10_000,
                       help="requests served by soak-engine (default: 10000)")
    bench.add_argument("--smoke", action="store_true", help="a seconds-long run that only checks the scenario works")
    bench.add_argument("--json", type=cli_args.output_path, metavar="PATH", help="write the records as JSON")
    bench.add_argument("--clients", type=cli_args.int_in(1, 4096), default=4, help="serve: concurrent chat clients (default: 4)")
    bench.add_argument("--turns", type=cli_args.int_in(1, 10**4), default=3, help="serve: turns per conversation (default: 3)")
    bench.add_argument("--system-tokens", type=cli_args.int_in(1, MAX_BENCH_CONTEXT),
                       help="serve, routing: the shared system prompts' tokens (default: 3840 serve, 256 routing)")
    bench.add_argument("--model", help="serve: a checkpoint directory or 'tiny' (default: a saved random Bamba)")
    bench.add_argument("--conversations", type=cli_args.int_in(1, 10**5), default=16,
                       help="routing: conversations, dealt to the clients (default: 16)")
    bench.add_argument("--state-slots", type=cli_args.int_in(5, 2**20), default=8,
                       help="routing: each replica's --num-state-slots (default: 8, scarce against its KV)")
    bench.add_argument("--system-prompts", type=cli_args.int_in(1, 10**4), default=2,
                       help="routing: distinct shared system prompts the conversations open with (default: 2)")
    bench.add_argument("--user-tokens", type=cli_args.int_in(1, MAX_BENCH_CONTEXT), default=24,
                       help="routing: each later turn's new user tokens (default: 24)")
    bench.add_argument("--checkpoint-policy", help="routing: the replicas' serve --policy (default: serve's own)")
    bench.add_argument("--load-tokens", type=cli_args.positive_float,
                       help="routing: the router's --load-tokens (default: the router's own)")
    bench.add_argument("--duration", type=cli_args.positive_float, help="serve: keep the clients going this many seconds")
    bench.set_defaults(handler=_bench)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (the serve extra)")
    from hybridcache.serving.arguments import add_arguments as add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(handler=_serve)
    from hybridcache.replay.cli import add_arguments as add_replay_arguments

    replay = commands.add_parser("replay", help="replay a request trace through the cache and measure hit rates")
    add_replay_arguments(replay)
    replay.set_defaults(handler=_replay)
    router = commands.add_parser("router", help="route OpenAI requests to replicas by what each can restore")
    router.add_argument("--replica", action="append", required=True, metavar="URL", help="a replica's base URL (repeat)")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=cli_args.int_in(0, 65535), default=8000)
    router.add_argument("--policy", default="restorable", help="restorable, kv-overlap or round-robin")
    router.add_argument("--health-interval", type=cli_args.positive_float, default=1.0,
                        help="seconds between health and load checks")
    router.add_argument("--load-tokens", type=cli_args.positive_float,
                        help="tokens one request sent by other routers counts for (default: the mean tokens to compute "
                             "of the requests this router routed; its own count as predicted)")
    router.add_argument("--upstream-timeout", type=cli_args.positive_float, metavar="S",
                        help="seconds a replica may stay silent within one answer before it counts as failed "
                             "(default: the router's UPSTREAM_TIMEOUT_S, 600)")
    router.add_argument("--client-timeout", type=cli_args.positive_float, metavar="S",
                        help="seconds a client may stay silent on one read or write before its connection is closed "
                             "(default: the router's CLIENT_TIMEOUT_S, 60)")
    router.add_argument("--max-connections", type=cli_args.int_in(1, 2**20), metavar="N",
                        help="clients served at once; one more is answered 503 (default: 256, or what the "
                             "file descriptor limit allows)")
    router.set_defaults(handler=_router)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return args.handler(args, argv)


if __name__ == "__main__":
    sys.exit(main())
