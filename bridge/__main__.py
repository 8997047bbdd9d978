"""Command line: arguments → settings → logging → the chosen command → exit code.

Exit codes (the same for `run` and `check`): 0 success; 1 a problem found at run time (`check`: a
peer — the world or the LLM — unreachable; `run`: a component crashed again and again, so systemd
restarts us); 2 invalid configuration, character files, token or memory directory: one plain line on
stderr for each problem, never a traceback (systemd does not restart exit code 2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from bridge import __version__, logs
from bridge.errors import ComponentFailed, ConfigError
from bridge.settings import Settings, load_settings, typo_warnings

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npc-bridge",
        description="Gives the shop-staff NPCs of a Colyseus world a voice from a local LLM. "
        "Configuration comes from NPC_BRIDGE_* environment variables (see README).",
    )
    parser.add_argument("--version", action="version", version=f"npc-bridge {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("run", help="run the daemon (the default)")
    commands.add_parser(
        "check",
        help="validate configuration and characters, probe the world and the LLM; "
        "exit 2 for a configuration problem, 1 for an unreachable peer",
    )
    chat = commands.add_parser(
        "chat", help="talk to one character in the terminal through the daemon's prompt, backend, cleaning and memory"
    )
    chat.add_argument("npc_id", help="a character id, e.g. cafe-minori")
    chat.add_argument(
        "--explain", action="store_true", help="before each reply, show the memories in its prompt and why"
    )
    memory = commands.add_parser("memory", help="inspect or forget what an NPC remembers")
    memory_commands = memory.add_subparsers(dest="memory_command", metavar="ACTION", required=True)
    show = memory_commands.add_parser("show", help="print memories with their dates and the pending conversation")
    show.add_argument("npc_id")
    forget = memory_commands.add_parser("forget", help="forget one memory (its number from `show`) or all")
    forget.add_argument("npc_id")
    which = forget.add_mutually_exclusive_group(required=True)
    which.add_argument("number", nargs="?", type=int, help="the memory's number as `memory show` prints it")
    which.add_argument("--all", action="store_true", help="forget every memory of this NPC")
    which.add_argument("--pending", action="store_true", help="forget the pending conversation (not yet extracted)")
    return parser


def _stderr(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass  # stderr is gone: the exit code still says it


def _config_error(exc: ConfigError) -> int:
    for line in exc.lines:
        _stderr(f"npc-bridge: configuration error: {line}")
    return EXIT_CONFIG


def _drop_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _open_standard_descriptors() -> None:
    """Give a closed stdin/stdout/stderr /dev/null, so no socket or file the daemon opens later gets
    descriptor 1 and has log lines written into it. Logging still knows stdout was closed (its lines
    are counted as dropped)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)


def main(argv: Sequence[str] | None = None) -> int:
    _open_standard_descriptors()
    args = _parser().parse_args(argv)
    command = args.command or "run"
    try:
        settings = load_settings()
        if command == "run":
            return _run(settings)
        if command == "check":
            from bridge.check import run_check

            return asyncio.run(run_check(settings))
        if command == "chat":
            from bridge.chat import run_chat

            return asyncio.run(run_chat(settings, args.npc_id, explain=args.explain))
        if command == "memory":
            from bridge.memory.cli import forget_memory, show_memory
            from bridge.npc.characters import load_roster

            characters = load_roster(settings.characters_dir).characters
            if args.memory_command == "show":
                return asyncio.run(show_memory(settings, args.npc_id, characters))
            number = None if args.all else args.number
            return asyncio.run(forget_memory(settings, args.npc_id, number, characters, pending=args.pending))
    except ConfigError as exc:
        return _config_error(exc)
    except ComponentFailed as exc:
        _stderr(f"npc-bridge: {exc}")
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:
        # The reader of our output left (`npc-bridge check | head -1`): stop like any filter, without a
        # traceback; stdout goes to /dev/null so the interpreter's own flush at exit cannot fail again.
        _drop_stdout()
        return EXIT_PROBLEM
    finally:
        if logs.output is not None:
            logs.output.close()
    return EXIT_PROBLEM


def _run(settings: Settings) -> int:
    import structlog

    from bridge.app import App
    from bridge.npc.characters import load_roster
    from bridge.preflight import prepare_memory_dir

    warnings = typo_warnings()
    token = settings.require_token()
    logs.add_secret(token)
    roster = load_roster(settings.characters_dir)
    if not roster.voiced:
        raise ConfigError(
            f"NPC_BRIDGE_CHARACTERS_DIR: no character in {settings.characters_dir.resolve()} has talk 'worker'"
        )
    prepare_memory_dir(settings.memory_dir)
    logs.configure(fmt=settings.log_format, level=settings.log_level, log_content=settings.log_content, secrets=[token])
    for warning in warnings:
        structlog.get_logger(__name__).warning("setting_unknown", problem=warning)

    async def _main() -> int:
        app = App(settings, roster, token=token)
        return await app.run()

    return asyncio.run(_main())


if __name__ == "__main__":
    sys.exit(main())
