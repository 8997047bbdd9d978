"""npc-bridge: voices the shop-staff NPCs of a Colyseus world with a local LLM."""

__version__ = "0.1.0"
