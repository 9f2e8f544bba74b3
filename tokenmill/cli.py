"""The `tokenmill` command: generate, serve, router, eval and bench.

Engine flags are derived from EngineConfig's fields, so a new option appears on every command at
once. Errors print one line and exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from pathlib import Path

from tokenmill.bench.cli import add_bench_commands
from tokenmill.config import EngineConfig
from tokenmill.router.settings import add_router_args, router_settings

if typing.TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        if isinstance(kind, types.UnionType):  # "int | None" -> int; "int | str" -> either
            kinds = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = _int_or_word if kinds == [int, str] else kinds[0]
        if field.name == "model" and positional_model:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL",
                                help="built-in model name, .gguf file or safetensors folder")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=field.default)
        else:
            parser.add_argument(flag, type=kind, default=field.default,
                                help=f"(default: {field.default})")


def _int_or_word(value: str) -> int | str:
    """A flag that takes a number or a word such as auto (--quant-group-size)."""
    return int(value) if value.isdigit() else value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if getattr(args, "model_pos", None):
        values["model"] = args.model_pos
    return EngineConfig(**values)


def _generate(args: argparse.Namespace) -> None:
    from tokenmill.distributed.worker import run_node
    from tokenmill.engine.engine import LLMEngine

    config = engine_config_from_args(args)
    if config.node_rank > 0:  # this host only holds tensor-parallel ranks
        return run_node(config)
    engine = LLMEngine(config)
    try:
        _stream_generation(engine, args)
    finally:
        engine.shutdown()


def _stream_generation(engine: LLMEngine, args: argparse.Namespace) -> None:
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed_sampling,
                            stop=args.stop or None)
    prompt: str = args.prompt
    if args.chat:
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request("cli", prompt, params,
                           prompt_token_ids=engine.tokenizer.encode(prompt,
                                                                    add_special_tokens=False))
    else:
        engine.add_request("cli", prompt, params)
    shown = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            if output.error:
                raise RuntimeError(output.error)
    sys.stdout.write("\n")


def _serve(args: argparse.Namespace) -> None:
    from tokenmill.distributed.worker import run_node
    from tokenmill.server.api import ServerSettings
    from tokenmill.server.auth import ApiKeys
    from tokenmill.server.launcher import serve

    config = engine_config_from_args(args)
    if config.node_rank > 0:  # this host only holds tensor-parallel ranks
        return run_node(config)
    if args.data_parallel_size < 1:
        raise ValueError(f"invalid option data_parallel_size={args.data_parallel_size}: must be "
                         ">= 1")
    if args.data_parallel_size > 1:
        return _serve_replicas(args, config)
    settings = ServerSettings(model_name=args.served_model_name or config.model,
                              api_keys=ApiKeys.parse(args.api_key),
                              max_waiting_requests=args.max_waiting_requests,
                              shutdown_timeout=args.shutdown_timeout,
                              log_interval=args.log_interval)
    serve(config, args.host, args.port, settings)


def _serve_replicas(args: argparse.Namespace, config: EngineConfig) -> None:
    """N replicas of this very command, each with its share of the threads, behind a router."""
    from tokenmill.router.replicas import run_data_parallel

    replicas = args.data_parallel_size
    if config.nnodes > 1 or config.dist_init_addr is not None:
        raise ValueError("invalid option data_parallel_size: replicas each pick their own "
                         "tensor-parallel rendezvous; drop --dist-init-addr and --nnodes")
    threads = max(1, (config.num_threads or os.cpu_count() or 1) // replicas)
    flags = _engine_flags(dataclasses.replace(config, num_threads=threads))
    for name in ("api_key", "served_model_name"):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    flags += ["--max-waiting-requests", str(args.max_waiting_requests), "--shutdown-timeout",
              str(args.shutdown_timeout), "--log-interval", str(args.log_interval)]
    run_data_parallel([flags] * replicas, router_settings(args, workers=[]), args.host,
                      args.port, args.shutdown_timeout)


def _engine_flags(config: EngineConfig) -> list[str]:
    """The flags that rebuild `config` on another command line (defaults left out)."""
    flags = []
    for field in dataclasses.fields(EngineConfig):
        value = getattr(config, field.name)
        if value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def _router(args: argparse.Namespace) -> None:
    from tokenmill.router.launcher import run_router

    run_router(router_settings(args, args.worker), args.host, args.port, args.shutdown_timeout)


def _eval(args: argparse.Namespace) -> None:
    from tokenmill.eval.configs import parse_config, parse_configs
    from tokenmill.eval.report import EvalOptions, run_eval

    options = EvalOptions(num_tokens=args.num_tokens, window=args.window,
                          max_questions=args.max_questions,
                          agreement_prompts=args.agreement_prompts,
                          agreement_tokens=args.agreement_tokens,
                          decode_tokens=args.decode_tokens)
    base = engine_config_from_args(args)
    if base.quantization == "auto":  # a format the names leave out is the float model's
        base = dataclasses.replace(base, quantization="none")
    report = run_eval(base, parse_config(args.reference), parse_configs(args.configs), options)
    print(report.table())
    print(f"perplexity text: {report.perplexity_text}")
    if args.output_json:
        report.save(Path(args.output_json))
    if args.max_ppl_increase is not None:
        breaches = report.floor_breaches(args.max_ppl_increase)
        for breach in breaches:
            print(f"tokenmill eval: quality floor broken: {breach}", file=sys.stderr)
        if breaches:
            sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one prompt, streamed")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    gen.set_defaults(handler=_generate)

    srv = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to listen on every interface")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", help="one API key, or a file of 'key tenant' lines (tenants "
                     "get separate prefix caches)")
    srv.add_argument("--served-model-name", help="the model name clients send (default: MODEL)")
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="answer 503 while this many requests wait for a first schedule")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds running requests get to finish on Ctrl-C or SIGTERM")
    srv.add_argument("--log-interval", type=float, default=5.0,
                     help="seconds between stats log lines")
    srv.add_argument("--data-parallel-size", type=int, default=1,
                     help="run this many engine replicas behind a router (router flags apply)")
    add_engine_args(srv, positional_model=True)
    add_router_args(srv)
    srv.set_defaults(handler=_serve)

    rtr = commands.add_parser("router", help="OpenAI-compatible router over engine replicas")
    rtr.add_argument("--worker", action="append", required=True,
                     help="a replica's base URL, e.g. http://10.0.0.2:8000; add #long to give "
                     "it the long prompts under --policy prompt_length (repeatable)")
    rtr.add_argument("--host", default="127.0.0.1")
    rtr.add_argument("--port", type=int, default=8000)
    rtr.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds open requests get to finish on Ctrl-C or SIGTERM")
    add_router_args(rtr)
    rtr.set_defaults(handler=_router)

    ev = commands.add_parser("eval", help="quality report: configurations against a reference")
    ev.add_argument("--configs", default="int8,int4,kv-int8",
                    help="comma-separated configurations, parts joined by '+': none, int8, int4, "
                         "int4-g32/64/128, gguf, kv-int8, bf16, fp32 (e.g. int8+kv-int8)")
    ev.add_argument("--reference", default="none",
                    help="the configuration compared with (default: unquantized, in --dtype)")
    ev.add_argument("--num-tokens", type=int, default=4096, help="perplexity slice, in tokens")
    ev.add_argument("--window", type=int, default=1024, help="tokens scored as one sequence")
    ev.add_argument("--max-questions", type=int, default=None,
                    help="ask this many of the 60 questions (default: all)")
    ev.add_argument("--agreement-prompts", type=int, default=12)
    ev.add_argument("--agreement-tokens", type=int, default=48)
    ev.add_argument("--decode-tokens", type=int, default=64,
                    help="single-stream decode tokens timed for tokens/s")
    ev.add_argument("--max-ppl-increase", type=float, default=None, metavar="PCT",
                    help="exit with status 1 when a configuration's perplexity rises more")
    ev.add_argument("--output-json", help="also write the results here")
    add_engine_args(ev)
    # The reference is the unquantized model in bf16; a small KV pool is plenty for the inputs.
    ev.set_defaults(handler=_eval, dtype="bfloat16", kv_cache_memory=0.25)
    add_bench_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Start-up facts (weights and KV cache sizes) go to stderr, away from the generated text.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("tokenmill: %(message)s"))
    logging.getLogger("tokenmill").addHandler(handler)
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    try:
        args.handler(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
