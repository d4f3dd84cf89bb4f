"""Where the paper's datasets come from: the hub by default, a local folder over it.

The hub cannot be reached from the test machines, so the hub path is checked around
`datasets.load_dataset`: the names and splits asked for, what is made of the rows it gives, and
a hub that cannot be reached (the session runs with HF_HUB_OFFLINE=1, as conftest sets).
"""

import json

import datasets
import pytest

from mmgrpo_jax import cli
from models.tiny_checkpoint import write_tiny_checkpoint
from programs import banking77, data, hover, papillon


@pytest.fixture
def no_local_data(monkeypatch):
    monkeypatch.delenv(data.ENV_VAR, raising=False)


def fake_hub(monkeypatch, tables):
    """`datasets.load_dataset` serving `tables[(name, config, split)]`; returns the calls."""
    calls = []

    def load_dataset(name, config=None, *, split):
        calls.append((name, config, split))
        return tables[(name, config, split)]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_the_hub_is_the_default_and_a_local_folder_overrides_it(
    no_local_data, tmp_path, monkeypatch
):
    assert data.resolve_data_dir() == data.HUB
    assert data.resolve_data_dir(tmp_path) == tmp_path
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    assert data.resolve_data_dir() == tmp_path
    assert data.resolve_data_dir("hub") == data.HUB  # named explicitly, over the variable
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path / "gone"))
    with pytest.raises(data.DataUnavailable, match=r"\$MMGRPO_DATA_DIR='.*gone' is not a dir"):
        data.resolve_data_dir()
    monkeypatch.setenv(data.ENV_VAR, "")  # `MMGRPO_DATA_DIR= mmgrpo ...`: unset
    assert data.resolve_data_dir() == data.HUB
    with pytest.raises(data.DataUnavailable, match=r"task\.data_dir='' is empty"):
        data.resolve_data_dir("")  # Path("") is the working directory: refused, not read


def test_banking77_from_the_hub_names_its_integer_labels(no_local_data, monkeypatch):
    names = [f"intent_{i:02d}" for i in range(77)]
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)}
    )

    def table(n, prefix):
        rows = {"text": [f"{prefix}{i}" for i in range(n)], "label": [i % 77 for i in range(n)]}
        return datasets.Dataset.from_dict(rows, features=features)

    hub = "PolyAI/banking77"
    calls = fake_hub(
        monkeypatch, {(hub, None, "train"): table(800, "q"), (hub, None, "test"): table(9, "t")}
    )
    assert banking77.label_names() == names
    splits = banking77.load_banking77()
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (250, 500, 9)
    assert [(e.text, e.label) for e in splits.test[:2]] == [
        ("t0", "intent_00"),
        ("t1", "intent_01"),
    ]
    assert all(e.label == f"intent_{int(e.text[1:]) % 77:02d}" for e in splits.train)
    assert {c[2] for c in calls} == {"train", "test"}


def test_pupa_from_the_hub_its_config_and_null_cells(no_local_data, monkeypatch):
    rows = [
        {
            "user_query": f"q{i}",
            "target_response": None if i == 0 else "r",
            "pii_units": None if i == 0 else "a||b",
        }
        for i in range(450)
    ]
    calls = fake_hub(
        monkeypatch, {("Columbia-NLP/PUPA", "pupa_new", "train"): datasets.Dataset.from_list(rows)}
    )
    splits = papillon.load_pupa()
    assert calls == [("Columbia-NLP/PUPA", "pupa_new", "train")]
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (111, 111, 221)
    assert splits.train[0].target_response == "" and splits.train[0].pii_units == []
    assert splits.test[0].user_query == "q222" and splits.test[0].pii_units == ["a", "b"]


def test_hover_from_the_hub_trains_on_its_train_release(no_local_data, monkeypatch, tmp_path):
    def row(i, hops):
        facts = [{"key": f"T{i}-{j}", "value": 0} for j in range(hops)]
        return {
            "claim": f"c{i}",
            "supporting_facts": facts,
            "num_hops": hops,
            "hpqa_id": str(i // 2),
        }

    train = [row(i, 3 if i % 3 else 2) for i in range(2400)]
    validation = [row(i, 3) for i in range(4)]
    fake_hub(
        monkeypatch,
        {
            ("hover-nlp/hover", None, "train"): datasets.Dataset.from_list(train),
            ("hover-nlp/hover", None, "validation"): datasets.Dataset.from_list(validation),
        },
    )
    splits = hover.load_hover()
    pool = hover.three_hop_claims(train)  # 3-title claims, first per hpqa_id
    assert len(pool) == len({r["hpqa_id"] for r in train if r["num_hops"] == 3})
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (500, 500, len(pool) - 1000)
    assert splits.train[0].titles == [
        f"{splits.train[0].claim.replace('c', 'T')}-{j}" for j in range(3)
    ]
    corpus = hover.write_title_proxy_corpus(None, tmp_path / "titles.jsonl")
    titles = [json.loads(line)["title"] for line in corpus.read_text().splitlines()]
    assert titles == [f"T{i}-{j}" for i in range(4) for j in range(3)]


def test_a_hub_that_cannot_be_reached_is_one_line_saying_how_to_work_offline(no_local_data):
    with pytest.raises(data.DataUnavailable) as caught:
        banking77.load_banking77()
    message = str(caught.value)
    assert "hub cannot be reached for PolyAI/banking77" in message
    assert "task.data_dir=PATH" in message and "docs/tasks.md" in message
    assert "\n" not in message


def test_a_hub_that_cannot_serve_a_dataset_is_named(no_local_data, monkeypatch):
    def scripted(*args, **kwargs):
        raise RuntimeError("Dataset scripts are no longer supported, but found hover.py")

    monkeypatch.setattr(datasets, "load_dataset", scripted)
    with pytest.raises(
        data.DataUnavailable,
        match=r"cannot serve hover-nlp/hover split 'train' "
        r"\(RuntimeError: Dataset scripts are no longer supported",
    ):
        hover.load_hover()


def test_eval_without_data_exits_2_in_one_line_before_the_model_loads(
    no_local_data, tmp_path, capsys
):
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "predictions.jsonl"
    argv = ["eval", "--program", "banking77", "--model", str(checkpoint), "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "mmgrpo eval: the Hugging Face hub cannot be reached for PolyAI/banking77"
    )
    assert len(err.splitlines()) == 1 and "task.data_dir=PATH" in err
    assert not out.exists()  # refused before anything was made
    assert cli.main([*argv, f"task.data_dir={tmp_path / 'none'}"]) == 2
    assert f"task.data_dir='{tmp_path / 'none'}' is not a directory" in capsys.readouterr().err
