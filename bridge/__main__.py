"""Command line: arguments → settings → logging → the chosen command → exit code.

Exit codes: 0 success, 1 a problem found at run time (`check` found something wrong, a command
failed), 2 invalid configuration or character files (one plain line on stderr naming the culprit).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from bridge import __version__, logs
from bridge.errors import ConfigError
from bridge.settings import Settings, load_settings

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
        "check", help="validate configuration and characters, probe the world and the LLM; exit 1 if anything is wrong"
    )
    chat = commands.add_parser(
        "chat", help="talk to one character in the terminal through the daemon's prompt, backend, cleaning and memory"
    )
    chat.add_argument("npc_id", help="a character id, e.g. cafe-minori")
    memory = commands.add_parser("memory", help="inspect or forget what an NPC remembers")
    memory_commands = memory.add_subparsers(dest="memory_command", metavar="ACTION", required=True)
    show = memory_commands.add_parser("show", help="print memories with their dates and the pending conversation")
    show.add_argument("npc_id")
    forget = memory_commands.add_parser("forget", help="forget one memory (its number from `show`) or all")
    forget.add_argument("npc_id")
    which = forget.add_mutually_exclusive_group(required=True)
    which.add_argument("number", nargs="?", type=int, help="the memory's number as `memory show` prints it")
    which.add_argument("--all", action="store_true", help="forget every memory of this NPC")
    return parser


def _config_error(message: str) -> int:
    print(f"npc-bridge: configuration error: {message}", file=sys.stderr, flush=True)
    return EXIT_CONFIG


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command or "run"
    try:
        settings = load_settings()
    except ConfigError as exc:
        return _config_error(str(exc))
    try:
        if command == "run":
            return _run(settings)
        if command == "check":
            from bridge.check import run_check

            return asyncio.run(run_check(settings))
        if command == "chat":
            from bridge.chat import run_chat

            return asyncio.run(run_chat(settings, args.npc_id))
        if command == "memory":
            from bridge.memory.cli import forget_memory, show_memory

            if args.memory_command == "show":
                return asyncio.run(show_memory(settings, args.npc_id))
            return asyncio.run(forget_memory(settings, args.npc_id, None if args.all else args.number))
    except ConfigError as exc:
        return _config_error(str(exc))
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_PROBLEM


def _run(settings: Settings) -> int:
    from bridge.app import App
    from bridge.npc.characters import load_roster

    token = settings.require_token()
    logs.add_secret(token)
    roster = load_roster(settings.characters_dir)
    if not roster.voiced:
        raise ConfigError(f"NPC_BRIDGE_CHARACTERS_DIR: no character in {settings.characters_dir} has talk 'worker'")
    logs.configure(fmt=settings.log_format, level=settings.log_level, log_content=settings.log_content, secrets=[token])
    settings.memory_dir.mkdir(parents=True, exist_ok=True)

    async def _main() -> int:
        app = App(settings, roster, token=token)
        return await app.run()

    return asyncio.run(_main())


if __name__ == "__main__":
    sys.exit(main())
