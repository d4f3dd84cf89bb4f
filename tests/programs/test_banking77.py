import json

import pytest

from mmgrpo_jax.program import Prediction
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.rl.rollout import run_trajectory
from mmgrpo_jax.testing import ScriptedLM
from programs.banking77 import Banking77, exact_match, label_names, load_banking77
from programs.data import DataUnavailable
from tests.paper_data import LOCAL_DATA, needs_paper_data


@needs_paper_data
def test_splits_sizes_fields_and_labels_from_the_data():
    splits = load_banking77()
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (250, 500, 3080)
    names = label_names()
    assert len(names) == 77 == len(set(names))
    assert names == json.loads((LOCAL_DATA / "banking77" / "hf_label_names.json").read_text())
    texts = [e.text for e in splits.train + splits.dev]
    assert len(set(texts)) > 740  # train and dev are disjoint draws from the pool
    for example in splits.train[:20] + splits.test[:20]:
        assert example.inputs() == {"text": example.text}
        assert example.label in names
    assert splits.test[0].text.strip() == "How do I locate my card?"
    assert load_banking77(seed=0).train == splits.train
    assert load_banking77(seed=1).train != splits.train


@needs_paper_data
def test_program_parses_a_label_and_rejects_unknown_ones():
    names = label_names()
    program = Banking77(names)
    predictor = program.classify
    reply = format_outputs(predictor.signature, {"reasoning": "lost card", "label": "card_arrival"})
    example = load_banking77().test[0]
    ok = run_trajectory(program, example, exact_match, lm=ScriptedLM(lambda m: reply))
    assert ok.status == "ok" and ok.prediction.label == "card_arrival"
    assert ok.reward == float(example.label == "card_arrival")
    assert "card_arrival" in ok.calls[0].messages[0]["content"]  # the choices are in the prompt
    bad = reply.replace("card_arrival", "not_an_intent")
    failed = run_trajectory(program, example, exact_match, lm=ScriptedLM(lambda m: bad))
    assert failed.status == "format_failure"


@needs_paper_data
def test_exact_match_metric():
    example = load_banking77().dev[0]
    assert exact_match(example, Prediction(label=example.label)) == 1.0
    assert exact_match(example, Prediction(label=example.label + "_")) == 0.0


def test_missing_data_dir_is_named(tmp_path):
    with pytest.raises(DataUnavailable, match=r"task\.data_dir='/nope' is not a directory"):
        load_banking77("/nope")
    with pytest.raises(DataUnavailable, match=r"hf_label_names\.json.*docs/tasks\.md"):
        load_banking77(tmp_path)
