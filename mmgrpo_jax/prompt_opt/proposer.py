"""Instruction candidates per predictor, written by a prompt model (any LM of the program layer).

The prompt model first reads the trainset in batches and writes observations about the data (one
call per batch: the dataset summary). Then, for each predictor and each candidate after the
first, it sees that summary, a description of the program (its docstring and its predictors'
signatures), the module's name and signature, up to 3 demos from one randomly drawn demo set,
the current instruction and one randomly drawn tip, and writes a new instruction. Candidate 0 is
always the current instruction.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
from collections.abc import Sequence

from mmgrpo_jax.program.adapter import ParseError
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module, Predict
from mmgrpo_jax.program.signature import Field, Signature
from mmgrpo_jax.prompt_opt.demos import DemoSets

logger = logging.getLogger(__name__)

TIPS = {
    "none": "",
    "creative": "Feel free to be inventive: an unusual framing may work better.",
    "simple": "Keep the instruction short and plain.",
    "description": "Describe the task and what a good answer looks like in detail.",
    "high_stakes": "Frame the task as one where a mistake would be costly.",
    "persona": 'Open with a persona suited to the task ("You are a ...").',
}

SUMMARIZE = Signature(
    (Field("examples", list[str], "rows of a dataset, as JSON"),),
    (Field("observations", str, "what the task is and what the rows have in common"),),
    "Study these dataset rows and write short observations about the task they come from: what "
    "goes in, what comes out, and any pattern worth knowing.",
)

PROPOSE = Signature(
    (
        Field("dataset_summary", str, "observations about the training data"),
        Field("program_description", str, "the LM program this module belongs to"),
        Field("module_name", str, "the module whose instruction is rewritten"),
        Field("module_signature", str, "the module's input and output fields"),
        Field("demos", list[str], "example calls of the module"),
        Field("current_instruction", str, "the module's instruction now"),
        Field("tip", str, "a hint on how to write the instruction"),
    ),
    (Field("proposed_instruction", str, "a new instruction for the module"),),
    "Write a better instruction for one module of an LM program, so that the LM performs the "
    "module's task well.",
)


def program_description(program: Module) -> str:
    doc = inspect.getdoc(type(program)) or type(program).__name__
    modules = "\n".join(f"- {n}: {p.signature}" for n, p in program.named_predictors())
    return f"{doc}\nModules:\n{modules}"


def summary_calls(num_examples: int, batch_size: int) -> int:
    return math.ceil(num_examples / batch_size)


class InstructionProposer:
    def __init__(
        self, prompt_lm: LM, *, summary_examples: int = 30, summary_batch: int = 10, seed: int = 0
    ) -> None:
        if summary_examples < 1 or summary_batch < 1:
            raise ValueError(
                f"summary_examples and summary_batch must be >= 1, got {summary_examples}, "
                f"{summary_batch}"
            )
        self.unparsed = 0  # prompt-model replies dropped because they did not parse
        self.summarize = Predict(SUMMARIZE, lm=prompt_lm)
        self.propose = Predict(PROPOSE, lm=prompt_lm)
        self.summary_examples, self.summary_batch, self.seed = (
            summary_examples,
            summary_batch,
            seed,
        )

    def num_calls(self, trainset_size: int, num_predictors: int, num_candidates: int) -> int:
        rows = min(trainset_size, self.summary_examples)
        return summary_calls(rows, self.summary_batch) + num_predictors * (num_candidates - 1)

    def dataset_summary(self, trainset: Sequence[Example]) -> str:
        rows = [json.dumps(dict(e), default=str) for e in trainset[: self.summary_examples]]
        notes = []
        for start in range(0, len(rows), self.summary_batch):
            batch = rows[start : start + self.summary_batch]
            try:
                notes.append(self.summarize(examples=batch).observations)
            except ParseError as err:
                self.unparsed += 1
                logger.warning("dataset summary of rows %d.. dropped: %s", start, err)
        return "\n".join(notes)

    def propose_instructions(
        self,
        program: Module,
        trainset: Sequence[Example],
        demo_sets: DemoSets,
        num_candidates: int,
    ) -> dict[str, list[str]]:
        """Per predictor: [current instruction, up to num_candidates - 1 proposals]; a reply that
        does not parse is dropped with a warning and counted in `unparsed` (a weak prompt model
        leaves fewer candidates, it does not stop the run)."""
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        summary = self.dataset_summary(trainset)
        description = program_description(program)
        candidates = {}
        for name, predictor in program.named_predictors():
            rng = random.Random(f"{self.seed}/propose/{name}")
            current = predictor.signature.instructions
            found = [current]
            for _ in range(num_candidates - 1):
                tip = TIPS[rng.choice(sorted(TIPS))]
                demo_set = rng.choice(demo_sets.get(name) or [[]])
                demos = [json.dumps(d, default=str) for d in demo_set[:3]]
                try:
                    reply = self.propose(
                        dataset_summary=summary,
                        program_description=description,
                        module_name=name,
                        module_signature=str(predictor.signature),
                        demos=demos,
                        current_instruction=current,
                        tip=tip,
                    )
                except ParseError as err:
                    self.unparsed += 1
                    logger.warning("a proposal for %s dropped: %s", name, err)
                    continue
                found.append(reply.proposed_instruction.strip() or current)
            candidates[name] = found
        return candidates
