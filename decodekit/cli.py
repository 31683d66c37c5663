"""The ``decodekit`` command line: ``decodekit generate "PROMPT" [strategy flags]``.

Bad input ends with a one-line message on stderr and a non-zero exit status, never a traceback.
Arguments are parsed before torch is imported, so ``--help`` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from decodekit._validation import in_interval, interval
from decodekit.fields import BY_NAME, CACHE_SIZES, FIELDS, Field
from decodekit.settings import DEFAULT_SYSTEM_PROMPT

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _bounded(
    kind: Callable[[str], Any],
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> Callable[[str], Any]:
    """An argparse type that parses with ``kind`` and checks the value lies in [low, high]."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not in_interval(value, low, high, low_open=low_open, high_open=high_open):
            span = interval(low, high, low_open=low_open, high_open=high_open)
            raise argparse.ArgumentTypeError(f"must be {span}; got {text}")
        return value

    return parse


def _field_type(field: Field) -> Callable[[str], Any]:
    """The argparse type of a Strategy field: the table's parsing, with its range in the message."""

    def parse(text: str) -> Any:
        try:
            return field.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = field.name
    return parse


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Flags that choose and place the model."""
    parser.add_argument(
        "--model",
        default=None,
        help="Hugging Face model id, local directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--device-map", default=None, help='accelerate device map, e.g. "auto" to spread layers over the GPUs present'
    )
    parser.add_argument("--dtype", default=None, help="float32, float16, bfloat16 or auto")


GROUPS = {
    "sampling": "sampling (greedy unless one of these is given)",
    "penalty": "repetition penalties (greedy or sampling)",
    "beam": "beam search (instead of greedy or sampling)",
    "cache": "compressed KV cache (evicts low-attention tokens)",
}


def add_strategy_flags(
    parser: argparse.ArgumentParser,
    families: Sequence[str] = tuple(GROUPS),
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """One flag per field of ``decodekit.fields`` of ``families``, grouped by family, with its range in the help;
    ``aliases`` gives a field more flags (``{"kv_memory_fraction": ("--memory-fraction",)}``).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_strategy_flags(parser, ("cache",), {"kv_memory_fraction": ("--memory-fraction",)})
        >>> parser.parse_args(["--memory-fraction", "0.1"]).kv_memory_fraction
        0.1
    """
    groups = {family: parser.add_argument_group(title) for family, title in GROUPS.items() if family in families}
    if "sampling" in groups:
        groups["sampling"].add_argument("--sample", action="store_true", help="sample at temperature 1 with no filter")
    sizes = groups["cache"].add_mutually_exclusive_group() if "cache" in groups else None  # one cache size
    for field in FIELDS:
        if field.family not in groups:
            continue
        target = sizes if field.name in CACHE_SIZES else groups[field.family]
        span = f", {field.span}" if field.span else ""
        metavar = field.name.upper() if field.kind != "texts" else "JSON_LIST"
        flags = (field.cli_flag, *(aliases or {}).get(field.name, ()))
        target.add_argument(
            *flags, dest=field.name, type=_field_type(field), metavar=metavar, help=f"{field.help}{span}"
        )


def strategy_from_args(args: argparse.Namespace) -> Any:
    """The Strategy that the strategy flags describe."""
    from decodekit.strategies import Strategy

    values = {field.name: getattr(args, field.name, None) for field in FIELDS}
    return Strategy(do_sample=True if getattr(args, "sample", False) else None, **values)


def _build_parser() -> argparse.ArgumentParser:
    from decodekit import __version__

    parser = argparse.ArgumentParser(
        prog="decodekit",
        description="Decoding strategies for transformers models.",
        epilog=_examples(
            'decodekit generate "The capital of France is" --max-new-tokens 16',
            "decodekit compress report.txt --memory-fraction 0.1 -o report.kv",
            "decodekit eval --limit 12 --max-new-tokens 48 --out reports/",
            "decodekit demo --port 7860",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"decodekit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        help="generate a continuation of one prompt, streamed as it comes",
        description="Generate a continuation of PROMPT, streamed to the terminal.",
        epilog=_examples(
            'decodekit generate "Write a haiku about the sea." --temperature 0.8 --min-p 0.05',
            'decodekit generate "Explain gravity to a child." --num-beams 4 --length-normalization gnmt',
            'decodekit generate "Summarize: ..." --kv-budget 256 --model ./my-model --device-map auto',
            'decodekit generate --context report.kv "Who signed the report?"   # after decodekit compress',
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("prompt", help="the prompt text (with --context: a question about the document)")
    add_model_flags(generate)
    generate.add_argument(
        "--context", metavar="FILE",
        help="answer from a document compressed by decodekit compress into FILE (a fork of it: the file is not "
        "changed); the model must be the one that compressed it",
    )  # fmt: skip
    generate.add_argument(
        "--max-new-tokens", type=_bounded(int, 1), default=128, help="most tokens to generate, >= 1 (default 128)"
    )
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the model's chat template")
    generate.add_argument(
        "--system",
        default=None,
        help=f'system message for chat models (default: "{DEFAULT_SYSTEM_PROMPT}"; "" keeps the chat template\'s own)',
    )
    generate.add_argument("--seed", type=int, default=None, help="random seed, for repeatable sampling")
    generate.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    generate.add_argument(
        "--trace", type=_bounded(int, 1), metavar="N",
        help="after the text, print every step's N likeliest tokens, their probabilities before and after the "
        "recipe's processors, and the token chosen",
    )  # fmt: skip
    generate.add_argument("--trace-json", metavar="FILE", help="write the step-by-step trace as JSON to FILE")
    add_strategy_flags(generate)
    generate.set_defaults(handler=_run_generate)
    _add_compress_command(commands)
    _add_eval_command(commands)
    demo = commands.add_parser(
        "demo",
        help="start the Gradio demo (strategies side by side)",
        description="Start the Gradio demo: one prompt, two strategies side by side, streamed.",
        epilog=_examples(
            "decodekit demo                       # http://127.0.0.1:7860",
            "decodekit demo --host 0.0.0.0 --port 8080 --auth-file demo-users.txt --max-concurrent 4",
            "decodekit demo --model HuggingFaceTB/SmolLM2-360M-Instruct --dtype bfloat16",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    demo.add_argument("--port", type=_bounded(int, 1, 65535), default=7860, help="port (default 7860)")
    demo.add_argument(
        "--auth-file", metavar="FILE",
        help="require a sign-in: one user:password a line (# comments); without it anyone who reaches the port "
        "may use the demo",
    )  # fmt: skip
    demo.add_argument(
        "--max-concurrent", type=_bounded(int, 1), default=2,
        help="generations running at once across all visitors; the rest wait in the queue (default 2)",
    )  # fmt: skip
    demo.add_argument("--max-queue", type=_bounded(int, 1), default=64, help="requests waiting at most (default 64)")
    demo.add_argument(
        "--max-beams",
        type=_field_type(BY_NAME["num_beams"]),
        default=8,
        help="largest beam count the page accepts (default 8)",
    )
    add_model_flags(demo)
    demo.set_defaults(handler=_run_demo)
    return parser


def check_address(host: str, port: int) -> None:
    """Raise ValueError if the demo could not listen on ``host:port`` (a busy port, an unknown host)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on ({error})") from None
    family, kind, protocol, _, address = infos[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            reason = "the port is in use" if error.errno == errno.EADDRINUSE else error.strerror or str(error)
            raise ValueError(f"cannot listen on {host}:{port}: {reason}; pick another --port or --host") from None


def _run_demo(args: argparse.Namespace) -> int:
    from decodekit.demo.access import read_auth_file
    from decodekit.demo.app import DemoLimits, launch
    from decodekit.models import load_model

    check_address(args.host, args.port)
    auth = read_auth_file(args.auth_file) if args.auth_file else None
    limits = DemoLimits(max_concurrent=args.max_concurrent, max_queue=args.max_queue, max_beams=args.max_beams)
    model, tokenizer = load_model(args.model, device_map=args.device_map, dtype=args.dtype)
    launch(model, tokenizer, host=args.host, port=args.port, limits=limits, auth=auth)
    return 0


def _add_eval_command(commands: Any) -> None:
    evaluation = commands.add_parser(
        "eval",
        help="compare decoding strategies: diversity, perplexity, reports and plots",
        description="Generate with a grid of strategies, score the generations and write JSON/CSV reports and "
        "PNG plots. Runs on several processes under accelerate launch or torchrun.",
        epilog=_examples(
            "decodekit eval --limit 12 --max-new-tokens 48 --out reports/",
            "decodekit eval --prompts my_prompts.jsonl --column question --batch-size 4",
            "decodekit eval --sweep min_p=0.02,0.05,0.1 --sweep temperature=0.7,1.0,1.5 --top-k 0 --seeds 3",
            "decodekit eval --strategies my_grid.yaml --seeds 3 --match-diversity 0.8",
            "accelerate launch -m decodekit.eval --out reports/",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flags(evaluation)
    evaluation.add_argument("--prompts", help="json/jsonl/csv/txt file of prompts (default: decodekit's own set)")
    evaluation.add_argument("--column", help='the prompts column (default "prompt", or "text")')
    evaluation.add_argument("--reference", help="text file scored under KV-cache compression (default: pydoc text)")
    evaluation.add_argument("--limit", type=_bounded(int, 1), help="use only the first N prompts")
    evaluation.add_argument("--max-new-tokens", type=_bounded(int, 1), default=64, help="per generation (64)")
    evaluation.add_argument("--batch-size", type=_bounded(int, 1), default=8, help="prompts per batch (8)")
    evaluation.add_argument("--seed", type=int, default=0, help="random seed (0)")
    evaluation.add_argument(
        "--seeds", type=_bounded(int, 1), default=1, help="seeds per sampling strategy, for the 95%% intervals (1)"
    )
    evaluation.add_argument(
        "--resamples", type=_bounded(int, 2), default=200, help="resamples behind each 95%% interval (200)"
    )
    evaluation.add_argument(
        "--grid", choices=("default", "samplers"), default=None,
        help="default: decodekit's recipes (without --strategies or --sweep); samplers: every sampler at each of "
        "--temperatures",
    )  # fmt: skip
    evaluation.add_argument(
        "--strategies", metavar="FILE",
        help="your own grid: a .json, .jsonl, .yaml or .csv file with one recipe a row (a label, optionally a "
        "preset, and any decoding fields); every row is checked before the model loads",
    )  # fmt: skip
    evaluation.add_argument(
        "--sweep", metavar="FIELD=V1,V2,...", action="append", type=_sweep, default=[],
        help="cross these values of a decoding field with the recipe the field flags below give (or with each "
        "--strategies row); repeat to cross several fields (a text field's values are separated by ';')",
    )  # fmt: skip
    evaluation.add_argument(
        "--match-diversity", metavar="X", type=_bounded(float, 0, 1),
        help="compare the samplers at equal diversity: for each sampler, the row of its sweep whose distinct-2 is "
        "nearest X, its perplexity with intervals (matched.png)",
    )  # fmt: skip
    evaluation.add_argument(
        "--temperatures", type=_temperatures, default=(1.0, 1.5),
        help="the sampler grid's temperatures, comma-separated (1.0,1.5); several draw temperature.png",
    )  # fmt: skip
    evaluation.add_argument("--context-tokens", type=_bounded(int, 1), default=1024, help="reference context (1024)")
    evaluation.add_argument(
        "--continuation-tokens", type=_bounded(int, 1), default=256, help="reference tokens scored (256)"
    )
    evaluation.add_argument("--out", default="reports", help="folder for the reports (default: reports/)")
    add_strategy_flags(evaluation)
    evaluation.set_defaults(handler=_run_eval)


def _sweep(text: str) -> tuple[str, tuple[Any, ...]]:
    """``--sweep FIELD=V1,V2``: the field and its checked values (``decodekit.eval.grids.parse_sweep``)."""
    from decodekit.eval.grids import parse_sweep

    try:
        return parse_sweep(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix(f"--sweep {text}: ")) from None


def eval_strategies(args: argparse.Namespace) -> list[Any] | None:
    """The grid ``decodekit eval`` runs, checked row by row before anything loads: the rows of
    ``--strategies``, crossed with every ``--sweep``, or the recipe the field flags give crossed with the
    sweeps, or a built-in ``--grid`` (None: the default grid).

    Example:
        >>> args = _build_parser().parse_args(["eval", "--sweep", "min_p=0.05,0.1", "--temperature", "0.7"])
        >>> [s.label for s in eval_strategies(args)]
        ['sample(temperature=0.7, min_p=0.05)', 'sample(temperature=0.7, min_p=0.1)']
    """
    from decodekit.eval.grids import read_strategies, sampler_grid, sweep_strategies

    flagged = {field.name: getattr(args, field.name) for field in FIELDS if getattr(args, field.name, None) is not None}
    custom = args.strategies or args.sweep or flagged or args.sample
    if args.grid and custom:
        raise ValueError("--grid runs a built-in grid: leave out --strategies, --sweep and the field flags, or --grid")
    if args.grid == "samplers":
        return sampler_grid(args.temperatures)
    if not custom:
        return None
    if args.strategies and (flagged or args.sample):
        names = ", ".join(BY_NAME[name].cli_flag for name in flagged) or "--sample"
        raise ValueError(f"--strategies takes its recipes from the file: put {names} in its rows, or --sweep it")
    for name, _ in args.sweep:
        if name in flagged:
            raise ValueError(f"{BY_NAME[name].cli_flag} and --sweep {name}=... both set {name}: keep one")
    if args.strategies:
        bases = read_strategies(args.strategies)
        return sweep_strategies(bases, args.sweep) if args.sweep else bases
    try:
        base = strategy_from_args(args)
    except (TypeError, ValueError) as error:
        raise ValueError(in_flags(str(error))) from None
    return sweep_strategies([base], args.sweep) if args.sweep else [base]


def _run_eval(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    from decodekit.eval.data_sources import load_prompts, load_reference
    from decodekit.eval.matching import matched_lines, with_interval
    from decodekit.eval.reports import check_output_dir, write_reports
    from decodekit.eval.runner import evaluate_strategies
    from decodekit.models import load_model

    check_output_dir(args.out)  # before any work: a bad --out must not cost a whole run
    strategies = eval_strategies(args)  # every row checked before the model loads
    prompts = load_prompts(args.prompts, args.column)[: args.limit]
    reference = load_reference(args.reference)
    model, tokenizer = load_model(args.model, device_map=args.device_map, dtype=args.dtype)
    try:
        report = evaluate_strategies(
            model, tokenizer, prompts, reference=reference, max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, seed=args.seed, seeds=args.seeds, resamples=args.resamples,
            strategies=strategies, context_tokens=args.context_tokens, continuation_tokens=args.continuation_tokens,
            match_diversity=args.match_diversity,
        )  # fmt: skip
        paths = write_reports(report, args.out) if PartialState().is_main_process else None
    except KeyboardInterrupt:
        print(
            f"\ndecodekit eval: interrupted; no new reports were written, and {args.out} holds the previous "
            "complete set (if any)",
            file=sys.stderr,
        )
        return 130
    if paths is not None:
        for row in report.strategies:
            print(f"{row['strategy']:32s} distinct-2 {with_interval(row, 'distinct_2', '.3f')}  "
                  f"perplexity {with_interval(row, 'perplexity', '.2f')}")  # fmt: skip
        if report.matched:
            print("\n".join(matched_lines(report.matched, args.match_diversity)))
        phases = ", ".join(f"{phase} {value:.0f} s" for phase, value in report.settings["seconds"].items())
        print(f"time: {phases}")
        print("reports: " + ", ".join(str(path) for path in paths.values()))
    return 0


def _temperatures(text: str) -> tuple[float, ...]:
    """``--temperatures``: comma-separated temperatures, each in the range a Strategy allows."""
    from decodekit.settings import TEMPERATURE_RANGE

    low, high = TEMPERATURE_RANGE
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, e.g. 0.7,1.0,1.5; got {text!r}") from None
    if not all(low <= value <= high for value in values):
        raise argparse.ArgumentTypeError(f"each temperature must be in [{low:g}, {high:g}]; got {text!r}")
    return values


def _quiet_libraries() -> None:
    """Keep library chatter (progress bars, info logs) off the user's terminal."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logger = logging.getLogger("decodekit")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("decodekit: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def in_flags(message: str) -> str:
    """A Strategy's message with its field names written as the flags a command-line user typed.

    Example:
        >>> in_flags("num_beams selects beam search, which does not sample: drop do_sample, kv_compression_ratio")
        '--num-beams selects beam search, which does not sample: drop --sample, --kv-ratio'
    """
    import re

    flags = {"do_sample": "--sample", **{field.name: field.cli_flag for field in FIELDS}}
    return re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda match: flags.get(match[0], match[0]), message)


def _run_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer, set_seed

    from decodekit.generation import check_max_new_tokens, check_prompts, prepare
    from decodekit.models import load_model

    check_prompts([args.prompt])
    if args.context:
        return _run_with_context(args)
    if args.trace_json:
        _check_writable(args.trace_json, "--trace-json")
    try:
        strategy = strategy_from_args(args)
    except (TypeError, ValueError) as error:
        raise ValueError(in_flags(str(error))) from None
    model, tokenizer = load_model(args.model, device_map=args.device_map, dtype=args.dtype)
    if args.seed is not None:
        set_seed(args.seed)
    check_max_new_tokens(args.max_new_tokens)
    if args.trace or args.trace_json:
        return _run_traced(args, model, tokenizer, strategy)
    batch, plan = prepare(model, tokenizer, [args.prompt], strategy, chat=False if args.raw else None,
                          system_prompt=_system(args))  # fmt: skip
    kwargs = plan.generate_kwargs()
    if not plan.streams and sys.stderr.isatty() and not args.no_stream:
        kwargs["on_step"] = BeamProgressLine(tokenizer)  # a beam's text can still change: show it on one line
    elif plan.streams and not args.no_stream:
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.inference_mode():
        output = model.generate(
            **batch, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs
        )
    if "streamer" not in kwargs:
        print(tokenizer.decode(output[0, batch["input_ids"].shape[1] :], skip_special_tokens=True))
    if plan.cache is not None:
        print(cache_summary(model, plan.cache), file=sys.stderr)
    return 0


def _system(args: argparse.Namespace) -> str:
    """``--system``, or the default system message when it was not given."""
    return DEFAULT_SYSTEM_PROMPT if args.system is None else args.system


def _run_with_context(args: argparse.Namespace) -> int:
    """``generate --context FILE "QUESTION"``: the question answered from a fork of a compressed document."""
    from transformers import TextStreamer, set_seed

    from decodekit.cache.persist import read_header
    from decodekit.context import Context
    from decodekit.generation import check_max_new_tokens
    from decodekit.models import load_model

    cache_flags = [
        field.cli_flag for field in FIELDS if field.family == "cache" and getattr(args, field.name) is not None
    ]
    if cache_flags:
        raise ValueError(
            f"{cache_flags[0]} applies when compressing (decodekit compress): the context {args.context} brings its "
            "own cache"
        )
    for flag, given in (("--raw", args.raw), ("--system", args.system is not None)):
        if given:
            raise ValueError(f"{flag} does not apply with --context: the document's framing was fixed when it was "
                             "compressed")  # fmt: skip
    for flag, given in (("--trace", args.trace), ("--trace-json", args.trace_json)):
        if given:
            raise ValueError(f"{flag} does not apply with --context")
    check_max_new_tokens(args.max_new_tokens)
    read_header(args.context)  # a missing or unreadable file is named before the model loads
    try:
        strategy = strategy_from_args(args)
    except (TypeError, ValueError) as error:
        raise ValueError(in_flags(str(error))) from None
    model, tokenizer = load_model(args.model, device_map=args.device_map, dtype=args.dtype)
    context = Context.load(args.context, model)
    if args.seed is not None:
        set_seed(args.seed)
    kwargs: dict[str, Any] = {}
    if strategy.beam and sys.stderr.isatty() and not args.no_stream:
        kwargs["on_step"] = BeamProgressLine(tokenizer)
    elif not strategy.beam and not args.no_stream:
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    answer = context.answer(model, tokenizer, args.prompt, strategy, max_new_tokens=args.max_new_tokens, **kwargs)
    if "streamer" not in kwargs:
        print(answer.text)
    print(f"{cache_summary(model, answer.cache)} (a fork of {args.context})", file=sys.stderr)
    return 0


def _add_compress_command(commands: Any) -> None:
    compress = commands.add_parser(
        "compress",
        help="compress a document's KV cache into a file, to ask it questions later (generate --context)",
        description="Read the document FILE into a compressed KV cache and save it to one file: by default a tenth "
        "of a full 16-bit cache's bytes, ranked by reconstruction (query-agnostic: which question comes is not "
        "known yet). Then ask it questions, each from a fork of it, with decodekit generate --context OUT.",
        epilog=_examples(
            "decodekit compress report.txt --memory-fraction 0.1 -o report.kv",
            'decodekit generate --context report.kv "Who signed the report?"',
            "decodekit compress notes.md --kv-budget 512 -o notes.kv",
            "decodekit compress book.txt --kv-ratio 0.9 --kv-scoring attention --model ./my-model",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compress.add_argument("file", metavar="FILE", help="the document: a UTF-8 text file, or - for standard input")
    compress.add_argument("-o", "--output", metavar="OUT", help="the file to write (default: FILE with the suffix .kv)")
    add_model_flags(compress)
    compress.add_argument(
        "--raw", action="store_true", help="keep the document as it is; by default a chat model gets it as the "
        "start of a user turn, which each question ends",
    )  # fmt: skip
    compress.add_argument(
        "--system", default=None,
        help=f'system message for chat models (default: "{DEFAULT_SYSTEM_PROMPT}"; "" keeps the chat template\'s own)',
    )  # fmt: skip
    add_strategy_flags(compress, families=("cache",), aliases={"kv_memory_fraction": ("--memory-fraction",)})
    compress.set_defaults(handler=_run_compress)


def _read_document(path: str) -> str:
    """The text of the document ``path`` (``-``: standard input); ValueError naming what is wrong."""
    from pathlib import Path

    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise ValueError(f"{path} is a folder: give a text file") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text") from None
        except OSError as error:
            raise ValueError(f"cannot read {path}: {error.strerror}") from None
    if not text.strip():
        raise ValueError(f"{'standard input' if path == '-' else path} is empty: the document needs some text")
    return text


def _run_compress(args: argparse.Namespace) -> int:
    """``compress FILE -o OUT``: the document read into a compressed cache, saved, with its numbers printed."""
    from pathlib import Path

    from tqdm import tqdm

    from decodekit.context import Context, document_ids
    from decodekit.generation import uses_chat_template
    from decodekit.models import load_model
    from decodekit.strategies import Strategy

    if args.output is None and args.file == "-":
        raise ValueError("reading the document from standard input: name the file to write with -o")
    output = args.output or str(Path(args.file).with_suffix(".kv"))
    if args.file != "-" and Path(output).resolve() == Path(args.file).resolve():
        raise ValueError(f"--output {output} is the document itself: name another file with -o")
    _check_writable(output, "--output")
    values = {field.name: getattr(args, field.name) for field in FIELDS if field.family == "cache"}
    if all(values[name] is None for name in CACHE_SIZES):
        values["kv_memory_fraction"] = 0.1
    values["kv_scoring"] = values["kv_scoring"] or "reconstruction"
    try:
        strategy = Strategy(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(in_flags(str(error))) from None
    text = _read_document(args.file)
    model, tokenizer = load_model(args.model, device_map=args.device_map, dtype=args.dtype)
    chat = uses_chat_template(tokenizer, False if args.raw else None)
    ids = document_ids(tokenizer, text, chat=chat, system_prompt=_system(args))
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and len(ids) >= limit:
        raise ValueError(
            f"{args.file} holds {len(ids)} tokens; the model reads at most {limit} positions, questions and answers "
            "included: give a shorter document"
        )
    bars = []

    def progress(done: int, total: int) -> None:  # the prompt's chunks (with a replay, its pass and the replay's)
        if not bars:
            bars.append(tqdm(total=total, unit="chunk", desc="compressing", file=sys.stderr, dynamic_ncols=True))
        bars[0].update(done - bars[0].n)

    try:
        context = Context.from_ids(
            model, ids, strategy.plan(model).cache, chat=chat, progress=progress, chunk=strategy.prefill_chunk
        )
    finally:
        for bar in bars:
            bar.close()
    path = context.save(output, source=Path(args.file).name if args.file != "-" else "-")
    numbers = context.summary(model)
    held, full = numbers["memory_bytes"], numbers["full_16bit_bytes"]
    print(
        f"{path}: {numbers['tokens_seen']} tokens seen, {numbers['tokens_kept']} kept per layer and KV head; "
        f"{held:,} bytes in memory ({held / full:.1%} of a full 16-bit cache's {full:,}), "
        f"{path.stat().st_size:,} bytes on disk"
    )
    return 0


def _run_traced(args: argparse.Namespace, model: Any, tokenizer: Any, strategy: Any) -> int:
    """``generate --trace N`` / ``--trace-json FILE``: the text, then each step's candidates."""
    import json

    from decodekit.trace import generate_with_trace

    trace = generate_with_trace(
        model, tokenizer, args.prompt, strategy, top=args.trace or 5, max_new_tokens=args.max_new_tokens,
        chat=False if args.raw else None, system_prompt=_system(args),
    )  # fmt: skip
    print(trace.text)
    if args.trace:
        for step in trace.steps:
            print(step.line())
    if args.trace_json:
        try:
            with open(args.trace_json, "w", encoding="utf-8") as handle:
                json.dump(trace.to_dict(), handle, ensure_ascii=False, indent=1)
        except OSError as error:
            raise ValueError(f"--trace-json: cannot write {args.trace_json}: {error.strerror}") from None
    return 0


def _check_writable(path: str, flag: str) -> None:
    """ValueError naming ``flag`` when ``path`` cannot be written (checked before the model loads)."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: cannot write {path}: the folder {folder} does not exist")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag}: cannot write {path}")


class BeamProgressLine:
    """``on_step`` for beam search on a terminal: the best hypothesis so far, on one stderr line."""

    def __init__(self, tokenizer: Any, interval: float = 0.1) -> None:
        import shutil
        import time

        self.tokenizer, self.interval, self._clock = tokenizer, interval, time.monotonic
        self.width = shutil.get_terminal_size().columns - 1
        self._shown_at = 0.0

    def __call__(self, step: Any) -> None:
        if self._clock() - self._shown_at < self.interval:
            return
        self._shown_at = self._clock()
        text = self.tokenizer.decode(step.sequences[0, step.prompt_length :], skip_special_tokens=True)
        line = f"[beam step {step.step}] " + " ".join(text.split())
        if len(line) > self.width:
            line = line[: self.width - 1] + "…"
        print(f"\r\033[K{line}", end="", file=sys.stderr, flush=True)

    def end(self) -> None:
        print("\r\033[K", end="", file=sys.stderr, flush=True)


def cache_summary(model: Any, cache: Any) -> str:
    """One line of a compressed cache's statistics against the full cache it replaced."""
    from decodekit.cache import full_cache_bytes

    seen = cache.get_seq_length()
    full = full_cache_bytes(model, seen)
    held = cache.memory_bytes()
    return (
        f"KV cache: {seen} tokens seen, {cache.kept_tokens} kept per layer and KV head; "
        f"{held / 1024:.0f} KiB held against {full / 1024:.0f} KiB for the full cache ({held / full:.0%})"
    )


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``decodekit`` console script and ``python -m decodekit``."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        _quiet_libraries()
        return args.handler(args)
    except KeyboardInterrupt:
        print("\ndecodekit: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        from decodekit.models import ModelLoadError

        if not isinstance(error, (ModelLoadError, ValueError, TypeError)):
            raise
        print(f"decodekit {args.command}: error: {error}", file=sys.stderr)
        return EXIT_FAILURE if isinstance(error, ModelLoadError) else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
