"""A config class whose fields carry their help the ways config classes write it."""

import dataclasses

from mmgrpo_jax.config_files import setting


@dataclasses.dataclass(frozen=True)
class Noted:
    plain: int = setting(1, "what plain is for")
    made: tuple[int, ...] = setting(note="made fresh for each config", factory=tuple)
    spelled: str = dataclasses.field(default="x", metadata={"help": "TRL's own spelling"})
    bare: float = 0.5  # a comment is for the reader of the code, not --help
