"""Training rows from groups, and the one `Batch` pytree the jitted step scans
(docs/design.md#architecture).

A row is one (prompt, completion) pair from a trace: the exact sampled token ids, never text
re-rendered from parsed fields. Every row carries a unit id: the sequence it belongs to in the
loss's sequence-level aggregations (its own, its group member's with a "trajectory" grouping
rule, or its rollout's or example's with `MMGRPOConfig.loss_unit`). Rows are right-padded into
[A, b, L] micro-batches whose length L is bucketed; a unit never spans two micro-batches; the
loss mask covers completion targets only. A new per-token input for a loss is one field of
`Batch`, filled in `pack_rows` and read by name in the loss (`TokenInputs.batch`). With
per-module adapters every row carries its module's adapter id (`Batch.adapter_ids`), so one
pass over a mixed batch trains each adapter on its own module's rows. Shapes: A micro-batches
(accumulation steps), b rows each, L tokens; packed, P sequences of Lp tokens.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mmgrpo_jax.rl.grouping import Group
from mmgrpo_jax.sampler.shapes import TOKEN_GRANULE, bucket, token_bucket

# what a row's unit id groups: a grouping rule's "row" / "trajectory" (a group member), or a
# loss_unit's "rollout" (a trajectory across groups) / "example"
RowUnit = Literal["row", "trajectory", "rollout", "example"]
ROW_UNITS: tuple[str, ...] = get_args(RowUnit)

ROW_LENGTH_GRANULE = 64  # training rows up to TOKEN_GRANULE tokens: multiples of this past it


def row_length_bucket(n: int) -> int:
    """The padded length of a micro-batch whose longest row has n tokens: powers of two up to
    64, multiples of 64 up to 512 (a 190-token row pads to 192, not 256: padding is a full
    forward and backward pass), then the sampler's buckets (few shapes where compiles cost)."""
    if n <= TOKEN_GRANULE:
        return bucket(n, 16, ROW_LENGTH_GRANULE)
    return token_bucket(n)


@dataclasses.dataclass(frozen=True)
class Row:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float
    unit: int = -1  # rows sharing a unit id >= 0 are one sequence of the loss; -1: its own
    sampler_logprobs: tuple[float, ...] | None = None
    in_loss: bool = True  # False: a truncated completion kept only as a fully masked row
    adapter: int = 0  # the LoRA adapter of the row's module (per-module adapters)
    module: str = ""  # the predictor that made the call (per-module metrics)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a training row needs at least one prompt token")
        if self.adapter < 0:
            raise ValueError(f"a row's adapter id must be >= 0, got {self.adapter}")


def rows_from_groups(
    groups: Sequence[Group],
    advantages: Sequence[np.ndarray],
    *,
    unit: RowUnit = "row",
    mask_truncated_completions: bool = False,
    adapter_of: Callable[[str], int] | None = None,
) -> list[Row]:
    """One row per (member, call): the exact sampled ids, the member's advantage, and the
    adapter `adapter_of(predictor name)` of its module (0 without per-module adapters).

    The unit says which rows the loss normalises together. `"row"`: every row alone.
    `"trajectory"` (a grouping rule's): every group member is one unit with its own id, so a
    member that padding or select-K repeated counts twice, as TRL trains a repeated completion
    twice. `"rollout"` (`loss_unit="trajectory"`): all rows of one rollout of one example, across
    every group it has calls in (a repeat inside a group is again a unit of its own); under
    trajectory-level groups this is the member. `"example"`: all rows of all rollouts of one
    example.
    """
    if unit not in ROW_UNITS:
        raise ValueError(f"unit must be one of {ROW_UNITS}, got {unit!r}")
    rows: list[Row] = []
    ids: dict[tuple, int] = {}  # a unit's key -> its id
    members = []
    for group, group_advantages in zip(groups, advantages, strict=True):
        repeats: Counter[int] = Counter()  # a rollout's members so far in this group
        for member, advantage in zip(group.members, group_advantages, strict=True):
            repeats[member.rollout_index] += 1
            key = {
                "row": None,
                "trajectory": ("member", len(members)),
                "rollout": (
                    group.example_index,
                    member.rollout_index,
                    repeats[member.rollout_index],
                ),
                "example": (group.example_index,),
            }[unit]
            members.append(
                (member, advantage, None if key is None else ids.setdefault(key, len(ids)))
            )
    for member, advantage, member_unit in members:
        for call in member.calls:
            if call.prompt_ids is None or call.completion_ids is None:
                raise ValueError(
                    f"call {call.predictor}[{call.invocation}] has no token ids; train with an "
                    "LM that returns them (an engines.EngineLM)"
                )
            if not call.completion_ids:
                continue  # nothing was generated: no token to train
            truncated = call.finish_reason == "length"
            rows.append(
                Row(
                    call.prompt_ids,
                    call.completion_ids,
                    float(advantage),
                    len(rows) if member_unit is None else member_unit,
                    call.logprobs,
                    in_loss=not (mask_truncated_completions and truncated),
                    adapter=0 if adapter_of is None else adapter_of(call.predictor),
                    module=call.predictor,
                )
            )
    return rows


@flax.struct.dataclass
class Batch:
    """Every array of a step's update, leading axis A: one entry per micro-batch it accumulates."""

    tokens: jax.Array  # [A, b, L]
    valid: jax.Array  # [A, b, L] real tokens (prompt and completion)
    loss_mask: jax.Array  # [A, b, L-1] targets that are completion tokens
    advantages: jax.Array  # [A, b]
    unit_ids: jax.Array  # [A, b] unit of each row, renumbered per micro-batch; -1 = padding
    sampler_logps: jax.Array  # [A, b, L-1] the sampler's log-probs of the targets, 0 elsewhere
    has_sampler_logps: jax.Array  # [A, b] rows whose LM returned log-probs
    num_sequences: jax.Array  # [A] units in the whole step (the same in every entry)
    num_tokens: jax.Array  # [A] completion tokens in the whole step (the same in every entry)
    old_logps: jax.Array | None = None  # [A, b, L-1] before the step's first update
    # The completion targets, C per forward sequence: only these positions go through the
    # lm_head; their log-probs land at (target_row, target_slot) of the rows' [L-1] layout.
    # Unpacked, sequence i is row i (C: the step's longest completion, bucketed); packed, the
    # targets are grouped by the sequence that predicts them, so a gather stays within a
    # sequence and the lm_head scores at most the sequences' own positions.
    # [A, P, C] below: P forward sequences (P = b unpacked)
    target_index: jax.Array | None = None  # [A, P, C] the position in its sequence predicting it
    target_tokens: jax.Array | None = None  # [A, P, C] the completion token it predicts
    target_slot: jax.Array | None = None  # [A, P, C] its index in [L-1]; L-1 = padding (dropped)
    target_row: jax.Array | None = None  # [A, P, C] packed: its row in [b]; None: row = sequence
    # Packed rows (`pack_rows(pack=...)`): tokens and valid are then [A, P, Lp], P sequences
    # of Lp tokens each holding several rows, and the per-row fields above keep their
    # [A, b, L-1] layout.
    positions: jax.Array | None = None  # [A, P, Lp] a token's index in its own row
    segments: jax.Array | None = None  # [A, P, Lp] rows packed apart: which row; -1 = padding
    # a prefix tree (`share_prompts`): the slot after each token's subtree, the rows sharing it
    # (AttentionMask.kv_reach); -1 = padding
    reach: jax.Array | None = None  # [A, P, Lp]
    # per-module adapters: each row's adapter id (padding rows 0); None with one adapter
    adapter_ids: jax.Array | None = None  # [A, b]
    # per-module adapters, packed: each token's adapter id (padding 0)
    token_adapters: jax.Array | None = None  # [A, P, Lp]

    @property
    def use_lora(self) -> jax.Array | bool:
        """What the model's `use_lora` takes for these rows: their tokens' or rows' adapter
        ids, or True with one adapter."""
        if self.token_adapters is not None:
            return self.token_adapters
        return True if self.adapter_ids is None else self.adapter_ids

    @property
    def padding_fraction(self) -> float:
        """The share of the forward pass's token slots that hold no token."""
        valid = np.asarray(self.valid)
        return float(1.0 - valid.sum() / valid.size)


def _unit_key(row: Row, index: int) -> tuple[bool, int]:
    """A row's unit: its id, or (without one) the row itself."""
    return (True, row.unit) if row.unit >= 0 else (False, index)


def _units(rows: Sequence[Row]) -> list[list[int]]:
    """Row indices per unit in first-appearance order."""
    by_unit: dict[tuple[bool, int], list[int]] = {}
    for k, row in enumerate(rows):
        by_unit.setdefault(_unit_key(row, k), []).append(k)
    return list(by_unit.values())


def micro_batch_layout(rows: Sequence[Row], micro_batch_size: int) -> list[list[int]]:
    """Row indices of each micro-batch.

    A unit's rows must share a micro-batch (the loss normalises by the unit's total tokens), so
    rows are laid out unit by unit and a micro-batch is closed before a unit that would not fit;
    a unit larger than the micro-batch is an error.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not rows:
        raise ValueError("no rows to pack")
    chunks: list[list[int]] = [[]]
    for members in _units(rows):
        if len(members) > micro_batch_size:
            raise ValueError(
                f"loss unit {rows[members[0]].unit} (a trajectory or an example) has "
                f"{len(members)} rows, more than micro_batch_size={micro_batch_size}; raise it"
            )
        if len(chunks[-1]) + len(members) > micro_batch_size:
            chunks.append([])
        chunks[-1] += members
    return chunks


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where a packed row's tokens sit in its micro-batch: its sequence, and the slot of each
    of its tokens, prompt then completion. A row packed apart holds contiguous slots; in a
    prefix tree its first slots are those of the earlier row it shares them with."""

    sequence: int
    slots: np.ndarray  # [prompt + completion] int


@dataclasses.dataclass(frozen=True)
class PackShape:
    """A packed micro-batch: `sequences` sequences of `length` tokens."""

    sequences: int
    length: int


def pack_shape(
    rows: Sequence[Row],
    micro_batch_size: int,
    cap: int = 0,
    share_prompts: bool = True,
    row_multiple: int = 1,
) -> PackShape:
    """The packed micro-batch a step's rows get, chosen from the rows.

    It holds no more token slots than the padded micro-batch would (`micro_batch_size` rows of
    the longest row's bucket), so packing never needs more memory than padding. With
    `share_prompts` its sequences are long enough for the largest tree one prompt grows (a
    group's G calls of a module on one input: the prompt once, then each completion), so that
    prompt is computed once; `cap` > 0 bounds a sequence's length (it must hold the longest
    row). Lengths are `row_length_bucket`s, so a run compiles few shapes.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not rows:
        raise ValueError("no rows to pack")
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    if cap and cap < longest:
        raise ValueError(
            f"a training row of {longest} tokens does not fit memory.pack_length={cap}; raise "
            "it to at least sampler.max_prompt_tokens + max_completion_tokens, or set 0 (no cap)"
        )
    padded = row_length_bucket(longest)
    budget = micro_batch_size * padded
    want = padded
    if share_prompts:
        trees: dict[tuple[int, tuple[int, ...]], int] = {}
        for r in rows:
            key = (r.adapter, r.prompt_ids)
            trees[key] = trees.get(key, len(r.prompt_ids)) + len(r.completion_ids)
        want = max(want, row_length_bucket(max(trees.values())))
    length = min(want, budget, cap or budget)
    length = max(length, longest)
    sequences = max(budget // length // row_multiple, 1) * row_multiple
    return PackShape(sequences, length)


def batch_layout(
    rows: Sequence[Row],
    micro_batch_size: int,
    pack: PackShape | None = None,
    share_prompts: bool = False,
    keep_micro_batches: bool = False,
) -> tuple[list[list[int]], list[list[Placement]] | None]:
    """`pack_rows`'s layout: row k of micro-batch m is `rows[layout[m][k]]` in every per-row
    field (packed or not), and with `pack` each row's placement."""
    if pack is None:
        if share_prompts:
            raise ValueError("share_prompts needs packed rows (memory.pack true)")
        return micro_batch_layout(rows, micro_batch_size), None
    given = micro_batch_layout(rows, micro_batch_size) if keep_micro_batches else None
    return pack_layout(rows, pack.sequences, pack.length, share_prompts, given)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _place(
    rows: Sequence[Row],
    tokens: Sequence[np.ndarray],
    members: Sequence[int],
    sequences: int,
    pack_length: int,
    share_prompts: bool,
) -> list[Placement] | None:
    """Placements of rows `members` in `sequences` sequences of `pack_length` tokens, or None
    when they do not fit.

    Apart: each row first-fit into a sequence with room for all of it. Shared: the rows in
    lexicographic order of (adapter, tokens), each laid after the last with only the tokens
    past their common prefix, which it reuses; that builds each sequence's prefix tree (a trie
    of the rows' tokens) depth first, so every token's subtree is the slots after it up to its
    reach (`_packed_sequences`). A row that does not fit what is left opens the next sequence.
    """
    spots: dict[int, Placement] = {}
    if not share_prompts:
        fill = [0] * sequences
        for k in members:
            n = len(tokens[k])
            seq = next((i for i, used in enumerate(fill) if used + n <= pack_length), None)
            if seq is None:
                return None
            spots[k] = Placement(seq, fill[seq] + np.arange(n))
            fill[seq] += n
        return [spots[k] for k in members]
    order = sorted(members, key=lambda k: (rows[k].adapter, tuple(tokens[k])))
    seq, fill, last = 0, 0, None
    for k in order:
        shared = 0
        if last is not None and rows[last].adapter == rows[k].adapter:
            shared = _common_prefix(tokens[last], tokens[k])
        new = len(tokens[k]) - shared
        if fill + new > pack_length:
            seq, fill, shared, new = seq + 1, 0, 0, len(tokens[k])
            if seq == sequences:
                return None
        reused = spots[last].slots[:shared] if shared else np.zeros(0, np.int64)
        spots[k] = Placement(seq, np.concatenate([reused, fill + np.arange(new)]))
        fill += new
        last = k
    return [spots[k] for k in members]


def pack_layout(
    rows: Sequence[Row],
    sequences: int,
    pack_length: int,
    share_prompts: bool = False,
    micro_batches: Sequence[Sequence[int]] | None = None,
) -> tuple[list[list[int]], list[list[Placement]]]:
    """Row indices of each micro-batch, and each row's placement inside it.

    Units go in order (with `share_prompts`, in order of their first row's adapter and
    prompt, so prompts that share a prefix meet), and a micro-batch takes units while its
    rows still fit its `sequences` sequences (`_place`); a unit never spans two. Given
    `micro_batches` (the padded layout's rows, which bnpo's per-micro-batch mean needs), each
    is packed as it is. A row longer than `pack_length`, or a unit that fits no empty
    micro-batch, is an error naming the setting.
    """
    if sequences < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {sequences}")
    if not rows:
        raise ValueError("no rows to pack")
    tokens = [np.asarray(r.prompt_ids + r.completion_ids) for r in rows]
    too_long = [len(t) for t in tokens if len(t) > pack_length]
    if too_long:
        raise ValueError(
            f"a training row of {max(too_long)} tokens does not fit memory.pack_length="
            f"{pack_length}; raise it to at least sampler.max_prompt_tokens + "
            "max_completion_tokens"
        )

    def place(members: Sequence[int]) -> list[Placement] | None:
        return _place(rows, tokens, members, sequences, pack_length, share_prompts)

    if micro_batches is not None:
        placed = [place(chunk) for chunk in micro_batches]
        if any(spots is None for spots in placed):
            raise ValueError(
                f"a micro-batch of rows does not fit {sequences} sequences of "
                f"memory.pack_length={pack_length}"
            )
        return [list(chunk) for chunk in micro_batches], placed  # type: ignore[misc]
    units = _units(rows)
    if share_prompts:
        units.sort(key=lambda m: (rows[m[0]].adapter, rows[m[0]].prompt_ids))
    layout: list[list[int]] = []
    placements: list[list[Placement]] = []
    current: list[int] = []
    current_spots: list[Placement] = []
    for members in units:
        trial = current + members
        spots = place(trial)
        if spots is None:
            if current:
                layout.append(current)
                placements.append(current_spots)
            trial, spots = list(members), place(members)
            if spots is None:
                raise ValueError(
                    f"loss unit {rows[members[0]].unit} (a trajectory or an example) of "
                    f"{len(members)} rows, {sum(len(tokens[k]) for k in members)} tokens, does "
                    f"not fit micro_batch_size={sequences} sequences of memory.pack_length="
                    f"{pack_length}; raise either"
                )
        current, current_spots = trial, spots
    layout.append(current)
    placements.append(current_spots)
    return layout, placements


def pack_rows(
    rows: Sequence[Row],
    micro_batch_size: int,
    pack: PackShape | None = None,
    row_multiple: int = 1,
    num_adapters: int = 1,
    share_prompts: bool = False,
    keep_micro_batches: bool = False,
) -> Batch:
    """Right-padded micro-batches laid out by `micro_batch_layout`; unit ids renumbered.

    With `pack`, each micro-batch is instead `pack.sequences` sequences of `pack.length`
    tokens into which its rows are packed (`pack_layout`): the forward pass sees no row padded
    to the longest, positions count within each row, and the per-row fields (loss mask,
    advantages, units, sampler log-probs) are the same arrays as without packing, so the loss
    and its normalisers are unchanged. Rows packed apart attend within their own segment. With
    `share_prompts` every sequence is a prefix tree of its rows' tokens: rows that begin alike
    (a group's G calls of a module on one input, one module's instruction across inputs,
    replies that agree) hold their common prefix once, its hidden states and gradients are
    computed once, and each token attends exactly to its own row's earlier tokens (`reach`).
    Either way only the completion targets reach the lm_head (`target_index`), and the
    sequences axis is cut to what the fullest micro-batch fills (a power of two). The rows axis
    of every field is a multiple of `row_multiple` (the devices it splits over). With
    `num_adapters` > 1 the batch carries each row's adapter id, and packed, each token's
    (rows of several modules share a sequence, never a tree node). `keep_micro_batches` packs
    the padded layout's micro-batches as they are (bnpo's per-micro-batch token mean).
    """
    beyond = [r.adapter for r in rows if r.adapter >= num_adapters]
    if beyond:
        raise ValueError(f"a row's adapter id {beyond[0]} is not below num_adapters={num_adapters}")
    if micro_batch_size % row_multiple:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} does not split over {row_multiple} devices "
            "(data x fsdp); make it a multiple"
        )
    if pack is not None and pack.sequences % row_multiple:
        raise ValueError(
            f"{pack.sequences} packed sequences do not split over {row_multiple} devices "
            "(data x fsdp)"
        )
    layout, placements = batch_layout(
        rows, micro_batch_size, pack, share_prompts, keep_micro_batches
    )
    if placements is not None:  # as many sequences as the fullest micro-batch fills (bucketed)
        used = max(spot.sequence for spots in placements for spot in spots) + 1
        used = -(-bucket(used) // row_multiple) * row_multiple
        pack = PackShape(min(pack.sequences, used), pack.length)
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    length = row_length_bucket(longest)
    window = token_bucket(max(len(r.completion_ids) for r in rows))
    # packed: as many row slots as the fullest micro-batch needs (bucketed), one per row
    width = micro_batch_size if placements is None else bucket(max(map(len, layout)))
    width = -(-width // row_multiple) * row_multiple
    shape = (len(layout), width)
    tokens = np.zeros((*shape, length), np.int32)
    valid = np.zeros((*shape, length), bool)
    loss_mask = np.zeros((*shape, length - 1), bool)
    sampler_logps = np.zeros((*shape, length - 1), np.float32)
    has_sampler_logps = np.zeros(shape, bool)
    advantages = np.zeros(shape, np.float32)
    unit_ids = np.full(shape, -1, np.int32)
    adapter_ids = np.zeros(shape, np.int32)
    target_index = np.zeros((*shape, window), np.int32)
    target_tokens = np.zeros((*shape, window), np.int32)
    target_slot = np.full((*shape, window), length - 1, np.int32)
    for m, chunk in enumerate(layout):
        local: dict[tuple[bool, int], int] = {}
        for i, k in enumerate(chunk):
            row = rows[k]
            p, c = len(row.prompt_ids), len(row.completion_ids)
            tokens[m, i, : p + c] = row.prompt_ids + row.completion_ids
            valid[m, i, : p + c] = True
            loss_mask[m, i, p - 1 : p + c - 1] = row.in_loss  # logits at t predict token t + 1
            if row.sampler_logprobs is not None:
                sampler_logps[m, i, p - 1 : p + c - 1] = row.sampler_logprobs
                has_sampler_logps[m, i] = True
            advantages[m, i] = row.advantage
            adapter_ids[m, i] = row.adapter
            unit_ids[m, i] = local.setdefault(_unit_key(row, k), len(local))
            target_index[m, i, :c] = p - 1 + np.arange(c)
            target_tokens[m, i, :c] = row.completion_ids
            target_slot[m, i, :c] = p - 1 + np.arange(c)
    units = len(_units(rows))
    completion_tokens = sum(len(r.completion_ids) for r in rows if r.in_loss)
    packed = {}
    if placements is not None:
        packed = _packed_sequences(
            rows, layout, placements, pack, width, length, share_prompts, num_adapters > 1
        )
    return Batch(
        tokens=jnp.asarray(packed.pop("tokens", tokens)),
        valid=jnp.asarray(packed.pop("valid", valid)),
        loss_mask=jnp.asarray(loss_mask),
        advantages=jnp.asarray(advantages),
        unit_ids=jnp.asarray(unit_ids),
        sampler_logps=jnp.asarray(sampler_logps),
        has_sampler_logps=jnp.asarray(has_sampler_logps),
        num_sequences=jnp.full(shape[:1], units, jnp.float32),
        num_tokens=jnp.full(shape[:1], completion_tokens, jnp.float32),
        adapter_ids=jnp.asarray(adapter_ids) if num_adapters > 1 else None,
        target_index=jnp.asarray(packed.pop("target_index", target_index)),
        target_tokens=jnp.asarray(packed.pop("target_tokens", target_tokens)),
        target_slot=jnp.asarray(packed.pop("target_slot", target_slot)),
        **{k: jnp.asarray(v) for k, v in packed.items()},
    )


def _packed_sequences(
    rows: Sequence[Row],
    layout: list[list[int]],
    placements: list[list[Placement]],
    pack: PackShape,
    width: int,
    length: int,
    share_prompts: bool,
    per_token_adapters: bool,
) -> dict[str, np.ndarray]:
    """The packed tokens, valid, positions, segments (rows apart) or reach (a prefix tree),
    each token's adapter (several adapters), and each sequence's completion targets: where in
    it each is predicted, its token, its row and row slot.

    A token's reach is the slot after the last row through it: rows are laid out depth first
    (`_place`), so the slots from a token to its reach are exactly the rows that share it."""
    shape = (len(layout), pack.sequences, pack.length)
    tokens, valid = np.zeros(shape, np.int32), np.zeros(shape, bool)
    positions, segments = np.zeros(shape, np.int32), np.full(shape, -1, np.int32)
    reach, adapters = np.full(shape, -1, np.int32), np.zeros(shape, np.int32)
    # (position, token, row, slot) of every target, per (micro-batch, sequence)
    targets: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for m, spots in enumerate(placements):
        for i, (k, spot) in enumerate(zip(layout[m], spots, strict=True)):
            row, seq, slots = rows[k], spot.sequence, spot.slots
            p, c = len(row.prompt_ids), len(row.completion_ids)
            tokens[m, seq, slots] = row.prompt_ids + row.completion_ids
            valid[m, seq, slots] = True
            positions[m, seq, slots] = np.arange(p + c)
            adapters[m, seq, slots] = row.adapter
            if share_prompts:
                reach[m, seq, slots] = np.maximum(reach[m, seq, slots], slots[-1] + 1)
            else:
                segments[m, seq, slots] = i
            # completion token j is predicted at the slot of the row's token before it
            where = slots[p - 1 : p + c - 1]
            targets.setdefault((m, seq), []).extend(
                (int(where[j]), row.completion_ids[j], i, p - 1 + j) for j in range(c)
            )
    window = token_bucket(max(map(len, targets.values())))
    out = {
        "target_index": np.zeros((*shape[:2], window), np.int32),
        "target_tokens": np.zeros((*shape[:2], window), np.int32),
        "target_row": np.full((*shape[:2], window), width, np.int32),
        "target_slot": np.full((*shape[:2], window), length - 1, np.int32),
    }
    for (m, seq), found in targets.items():
        columns = np.asarray(found, np.int32).T
        for name, column in zip(("index", "tokens", "row", "slot"), columns, strict=True):
            out[f"target_{name}"][m, seq, : len(found)] = column
    packed = {"tokens": tokens, "valid": valid, "positions": positions}
    packed["reach" if share_prompts else "segments"] = reach if share_prompts else segments
    if per_token_adapters:
        packed["token_adapters"] = adapters
    return packed | out
