"""A config class whose fields carry comments the ways config classes write them."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Noted:
    # one line above,
    # and a second
    above: int = 1
    trailing: str = "x"  # at the end
    bare: float = 0.5

    # a comment a blank line away from a field is not its note

    # above it
    both: bool = True  # and at the end
