"""What a reload (SIGHUP) changes: the plan from the running roster and the freshly read files.

A pure function, so the rules are tested without a daemon:
- a character whose file changed is used as changed from the next reply;
- a newly voiced character is added (the daemon claims it and loads its memory);
- a voiced character whose file is gone, or who is no longer voiced, stays voiced as it was until the
  next restart: the world protocol has no way to hand an NPC back, so dropping it would leave the NPC
  claimed and silent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bridge.npc.characters import Character

REASON_REMOVED = "its file is gone from the characters folder"
REASON_NOT_VOICED = "its file no longer says talk 'worker'"


@dataclass(frozen=True)
class ReloadPlan:
    characters: dict[str, Character]  # what the roster is given
    added: list[str]  # newly voiced: to claim
    changed: list[str]  # voiced before and after, with a different file
    kept: dict[str, str]  # voiced only because the bridge cannot give them back: npc id -> why


def plan_reload(running: Mapping[str, Character], loaded: Mapping[str, Character]) -> ReloadPlan:
    """`running`: the voiced characters now; `loaded`: every character in the folder now."""
    characters = dict(loaded)
    kept: dict[str, str] = {}
    for npc_id, character in running.items():
        fresh = loaded.get(npc_id)
        if fresh is None or not fresh.voiced:
            characters[npc_id] = character
            kept[npc_id] = REASON_REMOVED if fresh is None else REASON_NOT_VOICED
    voiced = sorted(npc_id for npc_id, character in characters.items() if character.voiced)
    return ReloadPlan(
        characters=characters,
        added=[npc_id for npc_id in voiced if npc_id not in running],
        changed=[npc_id for npc_id in voiced if npc_id in running and characters[npc_id] != running[npc_id]],
        kept=kept,
    )
