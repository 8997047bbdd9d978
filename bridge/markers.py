"""Chat-template markers small models leak: the one list for the stop strings (llm/), the reply cleaner
(npc/) and the extraction parser (memory/). Everything from the first marker on is the model writing
another turn or its own template, never the answer."""

from __future__ import annotations

import re

# Sent as stop strings with every request (llm-backends.md "Stop strings"): they also save the tokens
# the model would spend writing the next turn.
TEMPLATE_STOP_STRINGS: tuple[str, ...] = (
    "<|",
    "<assistant",
    "<user",
    "<system",
    "<end_of_turn>",
    "<start_of_turn>",
    "</s>",
    "[INST]",
)

# Where text is cut (replies.md "Cleaning" step 1, memory.md "Parsing"): the stop strings, closing role
# tags and other templates' tokens. Only the list llm-backends.md names goes to the server as stop strings.
TEMPLATE_CUT_MARKERS: tuple[str, ...] = (
    *TEMPLATE_STOP_STRINGS,
    "</assistant",
    "</user",
    "</system",
    "<s>",
    "<<SYS>>",
    "<bos>",
    "<eos>",
    "<im_start>",
    "<im_end>",
)

_CUT = re.compile("|".join(re.escape(marker) for marker in TEMPLATE_CUT_MARKERS), re.IGNORECASE)


def first_template_marker(text: str) -> int | None:
    """Where the first chat-template marker starts (case-insensitive), if any."""
    found = _CUT.search(text)
    return None if found is None else found.start()
