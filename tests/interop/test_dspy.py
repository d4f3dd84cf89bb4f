"""The DSPy bridge: an unmodified dspy.Module traced, grouped and trained like a native program."""

import json
import re
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

dspy = pytest.importorskip("dspy", reason="the DSPy interop tests need the dspy extra")

from mmgrpo_jax.errors import UserError  # noqa: E402
from mmgrpo_jax.interop.dspy import (  # noqa: E402
    BareAdapter,
    DSPyProgram,
    PolicyLM,
    dspy_metric,
    from_dspy_examples,
)
from mmgrpo_jax.program import Example, Module, Predict  # noqa: E402
from mmgrpo_jax.rl.grouping import GroupingSettings, grouping_rule  # noqa: E402
from mmgrpo_jax.rl.rollout import run_rollouts  # noqa: E402
from mmgrpo_jax.testing.scripted import ScriptedLM  # noqa: E402


class KeywordQA(dspy.Module):
    """Two predictors, the second fed the first's output; DSPy's own ChatAdapter format."""

    def __init__(self):
        super().__init__()
        self.keyword = dspy.Predict("question -> keyword")
        self.answer = dspy.ChainOfThought("question, keyword -> answer")

    def forward(self, question):
        keyword = self.keyword(question=question).keyword
        return self.answer(question=question, keyword=keyword)


def headed(**fields):
    body = "\n\n".join(f"[[ ## {k} ## ]]\n{v}" for k, v in fields.items())
    return body + "\n\n[[ ## completed ## ]]"


def keyword_of(messages):
    """The keyword a prompt carries as an input (the second predictor's), or None."""
    match = re.search(r"\[\[ ## keyword ## \]\]\n(k\d+)", messages[-1]["content"])
    return None if match is None else match.group(1)


def question_of(messages):
    return re.search(r"\[\[ ## question ## \]\]\n([^\n]*)", messages[-1]["content"]).group(1)


def counting_lm(answer_for, broken=()):
    """Replies that depend on the prompt and on how often that prompt was seen (the r-th
    rollout's call sees count r when rollouts run in order): keyword k<r>, then an answer."""
    seen = {}
    lock = threading.Lock()

    def respond(messages):
        key = "\n".join(m["content"] for m in messages)
        with lock:
            count = seen[key] = seen.get(key, -1) + 1
        keyword = keyword_of(messages)
        if keyword is None:
            return headed(keyword=f"k{count}")
        if (question_of(messages), keyword) in broken:
            return "no headers at all"
        return headed(reasoning="because", answer=answer_for(question_of(messages), keyword))

    return ScriptedLM(respond, token_ids=True)


def exact(example, pred, trace=None):
    return float(example.answer == pred.answer)


TRAIN = [
    dspy.Example(question="capital of France?", answer="Paris").with_inputs("question"),
    dspy.Example(question="capital of Peru?", answer="Lima").with_inputs("question"),
]


def right_on_k1(question, keyword):
    return {"capital of France?": "Paris", "capital of Peru?": "Lima"}[question] * (
        keyword == "k1"
    ) or "Rome"


# -- the LM ---------------------------------------------------------------------------------------
def test_policy_lm_answers_a_dspy_predictor_with_usage_and_logprobs():
    lm = ScriptedLM(lambda messages: headed(answer="Paris"), token_ids=True, logprob=-0.25)
    policy = PolicyLM(lm, logprobs=True)
    with dspy.context(lm=policy):
        pred = dspy.Predict("question -> answer")(question="capital of France?")
    assert pred.answer == "Paris"
    completion = headed(answer="Paris")
    tokens = pred.logprobs["content"]
    assert [t["logprob"] for t in tokens] == [-0.25] * len(completion.encode())
    ((messages, _),) = lm.calls
    assert messages[0]["role"] == "system" and "`answer`" in messages[0]["content"]
    assert messages[-1]["role"] == "user" and "capital of France?" in messages[-1]["content"]
    usage = policy.history[-1]["usage"]
    prompt_bytes = len("\n".join(m["content"] for m in messages).encode())
    assert usage["prompt_tokens"] == prompt_bytes
    assert usage["completion_tokens"] == len(completion.encode())
    # not asked: none
    plain = PolicyLM(lm)
    with dspy.context(lm=plain):
        pred = dspy.Predict("question -> answer")(question="capital of France?")
    assert "logprobs" not in pred


def test_policy_lm_passes_dspy_sampling_settings_outside_a_run():
    lm = ScriptedLM(lambda messages: headed(answer="x"))
    with dspy.context(lm=PolicyLM(lm, temperature=0.7, max_tokens=12)):
        dspy.Predict("question -> answer")(question="q")
    assert lm.calls[-1][1] == {"max_new_tokens": 12, "temperature": 0.7}


def test_policy_lm_refuses_a_cache_and_says_when_it_has_no_policy():
    with pytest.raises(ValueError, match="every rollout alike"):
        PolicyLM(ScriptedLM(str), cache=True)
    with dspy.context(lm=PolicyLM()), pytest.raises(Exception, match="has no policy"):
        dspy.Predict("question -> answer")(question="q")


def test_policy_lm_on_the_jax_engine_samples_what_the_engine_lm_samples(tokenizer_and_model):
    from mmgrpo_jax.engines.base import Sampling
    from mmgrpo_jax.engines.lm import EngineLM

    model, tokenizer, stop = tokenizer_and_model
    lm = EngineLM.local(
        model, tokenizer, sampling=Sampling(8, temperature=0.0), stop_token_ids=stop
    )
    try:
        policy = PolicyLM(lm, logprobs=True)
        program = dspy.Predict("question -> answer")
        with dspy.context(lm=policy, adapter=BareAdapter()):
            pred = program(question="amber birch?")
        messages = BareAdapter().format(program.signature, [], {"question": "amber birch?"})
        direct = lm(messages)
        assert pred.answer == direct.text.strip()
        assert [t["logprob"] for t in pred.logprobs["content"]] == pytest.approx(
            list(direct.logprobs)
        )
    finally:
        lm.close()


@pytest.fixture(scope="module")
def tokenizer_and_model():
    from mmgrpo_jax.testing import tiny_decoder
    from models.lora import LoRAConfig
    from models.tokenizer import train_bpe_tokenizer
    from tests.trainer.conftest import CORPUS

    tokenizer = train_bpe_tokenizer(CORPUS, 300, "chatml")
    model = tiny_decoder(len(tokenizer), lora=LoRAConfig(rank=2, alpha=4.0), seed=0)
    return model, tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")]


# -- traces ---------------------------------------------------------------------------------------
def test_every_call_is_traced_with_its_name_ids_logprobs_and_invocation():
    lm = counting_lm(right_on_k1)
    program = DSPyProgram(KeywordQA())
    assert [n for n, _ in program.named_predictors()] == ["keyword", "answer.predict"]
    examples = from_dspy_examples(TRAIN[:1])
    trajectories = run_rollouts(
        program, examples, dspy_metric(exact), num_rollouts=3, lm=lm, max_workers=1
    )
    assert [t.status for t in trajectories] == ["ok"] * 3
    assert [t.reward for t in trajectories] == [0.0, 1.0, 0.0]  # k1 is the right keyword
    for r, trajectory in enumerate(trajectories):
        keyword, answer = trajectory.calls
        assert (keyword.predictor, keyword.invocation) == ("keyword", 0)
        assert (answer.predictor, answer.invocation) == ("answer.predict", 0)
        assert keyword.outputs == {"keyword": f"k{r}"}
        assert answer.inputs == {"question": "capital of France?", "keyword": f"k{r}"}
        assert answer.outputs["reasoning"] == "because"
        for call in trajectory.calls:
            assert call.parsed and call.messages[0]["role"] == "system"
            assert call.completion_ids == tuple(call.completion.encode())
            assert call.logprobs == (-0.5,) * len(call.completion_ids)
            assert call.prompt_ids is not None


class AskTwice(dspy.Module):
    def __init__(self):
        super().__init__()
        self.keyword = dspy.Predict("question -> keyword")

    def forward(self, question):
        first = self.keyword(question=question).keyword
        return self.keyword(question=f"{question} {first}")


def test_a_predictor_called_twice_gets_invocations_0_and_1():
    lm = ScriptedLM(lambda messages: headed(keyword="k"), token_ids=True)
    (trajectory,) = run_rollouts(
        DSPyProgram(AskTwice()),
        from_dspy_examples(TRAIN[:1]),
        lambda e, p: 1.0,
        num_rollouts=1,
        lm=lm,
    )
    assert [(c.predictor, c.invocation) for c in trajectory.calls] == [
        ("keyword", 0),
        ("keyword", 1),
    ]


class CatchesParseErrors(dspy.Module):
    def __init__(self):
        super().__init__()
        self.keyword = dspy.Predict("question -> keyword")

    def forward(self, question):
        try:
            return self.keyword(question=question)
        except dspy.utils.exceptions.AdapterParseError:
            return dspy.Prediction(keyword="fallback")


class Raises(dspy.Module):
    def __init__(self):
        super().__init__()
        self.keyword = dspy.Predict("question -> keyword")

    def forward(self, question):
        self.keyword(question=question)
        raise KeyError("the tool broke")


@pytest.mark.parametrize(
    ("program", "status", "reward", "error"),
    [
        (KeywordQA, "format_failure", -1.0, "ChatAdapter could not parse"),
        (CatchesParseErrors, "format_failure", -1.0, "keyword[0] failed to parse"),
        (Raises, "error", 0.0, "program raised KeyError"),
    ],
)
def test_failures_are_scored_as_for_native_programs(program, status, reward, error):
    lm = ScriptedLM(
        lambda m: "no headers" if program is not Raises else headed(keyword="k"), token_ids=True
    )
    (trajectory,) = run_rollouts(
        DSPyProgram(program()),
        from_dspy_examples(TRAIN[:1]),
        dspy_metric(exact),
        num_rollouts=1,
        lm=lm,
    )
    assert (trajectory.status, trajectory.reward) == (status, reward)
    assert error in trajectory.error
    (call,) = trajectory.calls  # the call made before the failure is kept
    assert call.predictor == "keyword"
    assert call.parsed is (program is Raises)
    if not call.parsed:
        assert call.parse_error and call.completion == "no headers"


def test_json_fallback_is_off_so_a_failed_parse_is_one_sample():
    lm = ScriptedLM(lambda m: "no headers", token_ids=True)
    with dspy.context(adapter=dspy.ChatAdapter(use_json_adapter_fallback=True)):
        (trajectory,) = run_rollouts(
            DSPyProgram(KeywordQA()),
            from_dspy_examples(TRAIN[:1]),
            dspy_metric(exact),
            num_rollouts=1,
            lm=lm,
        )
    assert trajectory.status == "format_failure" and len(lm.calls) == 1


def test_concurrent_rollouts_keep_their_own_traces():
    def respond(messages):
        time.sleep(0.002)  # interleave the threads
        keyword = keyword_of(messages)
        question = question_of(messages)
        if keyword is None:
            return headed(keyword=f"k{len(question)}")
        return headed(reasoning=question, answer=f"{question}|{keyword}")

    examples = from_dspy_examples(
        [dspy.Example(question="q" * (i + 1), answer="-").with_inputs("question") for i in range(6)]
    )
    trajectories = run_rollouts(
        DSPyProgram(KeywordQA()),
        examples,
        lambda e, p: 0.0,
        num_rollouts=4,
        lm=ScriptedLM(respond, token_ids=True),
    )
    assert len(trajectories) == 24
    for t in trajectories:
        question = examples[t.example_index].question
        assert t.status == "ok"
        assert [c.inputs["question"] for c in t.calls] == [question, question]
        assert t.calls[1].outputs["answer"] == f"{question}|k{len(question)}"


class FansOut(dspy.Module):
    """Calls its predictor from dspy.Parallel's worker threads."""

    def __init__(self):
        super().__init__()
        self.keyword = dspy.Predict("question -> keyword")

    def forward(self, question):
        parallel = dspy.Parallel(num_threads=3)
        pairs = [(self.keyword, {"question": f"{question} {i}"}) for i in range(3)]
        results = parallel(pairs)
        return dspy.Prediction(keyword=",".join(r.keyword for r in results))


def test_dspy_parallel_records_into_its_own_rollout():
    lm = ScriptedLM(lambda m: headed(keyword=question_of(m)), token_ids=True)
    examples = from_dspy_examples(
        [dspy.Example(question=f"ex{i}", answer="-").with_inputs("question") for i in range(3)]
    )
    trajectories = run_rollouts(
        DSPyProgram(FansOut()), examples, lambda e, p: 0.0, num_rollouts=2, lm=lm
    )
    for t in trajectories:
        question = examples[t.example_index].question
        assert sorted(c.outputs["keyword"] for c in t.calls) == [
            f"{question} {i}" for i in range(3)
        ]
        assert sorted(c.invocation for c in t.calls) == [0, 1, 2]


# -- metrics and data -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("metric", "want"),
    [
        (lambda example, pred, trace=None: 0.25, 0.25),
        (lambda example, pred, trace=None: example.answer == pred.answer, True),
        (lambda example, pred, trace=None: dspy.Prediction(score=0.5, feedback="ok"), 0.5),
        (lambda example, pred: 1.0, 1.0),  # two arguments: called with two
    ],
    ids=["float", "bool", "prediction", "two_args"],
)
def test_metrics_as_dspy_writes_them(metric, want):
    (example,) = from_dspy_examples(TRAIN[:1])
    assert dspy_metric(metric)(example, dspy.Prediction(answer="Paris")) == want


def test_a_metric_sees_a_dspy_example_with_its_input_keys():
    seen = []
    (example,) = from_dspy_examples(TRAIN[:1])
    dspy_metric(lambda ex, pred, trace=None: seen.append(ex) or 1.0)(example, None)
    assert isinstance(seen[0], dspy.Example)
    assert dict(seen[0].inputs()) == {"question": "capital of France?"}
    assert seen[0].answer == "Paris"


def test_a_prediction_without_a_score_is_an_error():
    (example,) = from_dspy_examples(TRAIN[:1])
    with pytest.raises(TypeError, match="without a score"):
        dspy_metric(lambda e, p, t=None: dspy.Prediction(feedback="?"))(example, None)


def test_examples_keep_their_input_keys_and_must_have_them():
    (example,) = from_dspy_examples(TRAIN[:1])
    assert example.inputs() == {"question": "capital of France?"}
    assert example.labels() == {"answer": "Paris"}
    with pytest.raises(UserError, match=r"trainset\[0\] has no input keys"):
        from_dspy_examples([dspy.Example(question="q")], "trainset")
    with pytest.raises(TypeError, match=r"valset\[0\] is a Example"):
        from_dspy_examples([Example(question="q").with_inputs("question")], "valset")


def test_a_predictor_with_its_own_lm_is_refused():
    program = KeywordQA()
    program.keyword.lm = dspy.LM("openai/gpt-4o-mini")
    with pytest.raises(UserError, match=r"'keyword': 'openai/gpt-4o-mini'"):
        DSPyProgram(program).check_policy()


def test_an_async_program_is_refused_in_one_line_before_training():
    """A program with only aforward was an internal AttributeError (type(program).forward)."""
    from mmgrpo_jax.interop.dspy import train

    class AsyncQA(dspy.Module):
        def __init__(self):
            super().__init__()
            self.answer = dspy.Predict("question -> answer")

        async def aforward(self, question):
            return await self.answer.acall(question=question)

    message = r"AsyncQA defines only aforward: async programs are not supported.*define forward"
    with pytest.raises(UserError, match=message):
        train(None, AsyncQA(), [], [])  # the trainer is not reached
    with pytest.raises(UserError, match=r"defines no forward"):
        DSPyProgram(dspy.Module())


def test_chain_of_thought_on_bare_adapter_is_refused_before_any_rollout():
    """BareAdapter writes one field per reply: a ChainOfThought on it failed every call (a
    ValueError inside each rollout) and the run ended "idle"."""
    from mmgrpo_jax.interop.dspy import train

    class Reasoned(dspy.Module):
        def __init__(self):
            super().__init__()
            self.think = dspy.ChainOfThought("question -> answer")
            self.short = dspy.Predict("question -> answer")

        def forward(self, question):
            return self.think(question=question)

    message = r"predictors \{'think.predict': \['reasoning', 'answer'\]\} have several"
    with dspy.context(adapter=BareAdapter()), pytest.raises(UserError, match=message):
        train(None, Reasoned(), [], [])  # the trainer is not reached
    DSPyProgram(Reasoned(), adapter=dspy.ChatAdapter()).check_adapter()  # headed: fine


# -- groups: the same as the native program's and as dspy.GRPO's ----------------------------------
class Answer(Module):
    def __init__(self):
        self.predict = Predict("question, keyword -> reasoning, answer")


class NativeKeywordQA(Module):
    """KeywordQA written natively: the same predictor names, fields and reply format."""

    def __init__(self):
        self.keyword = Predict("question -> keyword")
        self.answer = Answer()

    def forward(self, question):
        keyword = self.keyword(question=question).keyword
        return self.answer.predict(question=question, keyword=keyword)


BROKEN = {("capital of Peru?", "k2")}  # one answer per step that does not parse


def module_groups(program, metric, examples, grouping="module"):
    lm = counting_lm(right_on_k1, broken=BROKEN)
    trajectories = run_rollouts(program, examples, metric, num_rollouts=4, lm=lm, max_workers=1)
    settings = GroupingSettings(4, "truncate", None, 0, None, 0)
    groups = grouping_rule(grouping).group(trajectories, settings)
    return [
        (
            g.module,
            g.invocation,
            [(m.calls[0].outputs, m.calls[0].completion, m.reward) for m in g.members],
        )
        for g in groups
    ]


def test_groups_through_the_interop_equal_the_native_programs():
    native_examples = [
        Example(question=e.question, answer=e.answer).with_inputs("question") for e in TRAIN
    ]
    native = module_groups(NativeKeywordQA(), lambda e, p: exact(e, p), native_examples)
    bridged = module_groups(DSPyProgram(KeywordQA()), dspy_metric(exact), from_dspy_examples(TRAIN))
    assert len(bridged) == 4  # 2 examples x 2 modules
    assert [g[:2] for g in bridged] == [g[:2] for g in native]
    for (_, _, ours), (_, _, theirs) in zip(bridged, native, strict=True):
        # the same replies and rewards, member for member (the prompts differ: DSPy's
        # ChatAdapter words its system message its own way)
        assert [(c, r) for _, c, r in ours] == [(c, r) for _, c, r in theirs]
    assert -1.0 in [r for g in bridged for _, _, r in g[2]]  # the broken answer is in its group


class FakeReinforceJob:
    """What dspy.GRPO hands its groups to (Arbor's job in the paper's setup)."""

    def __init__(self):
        self.steps = []

    def get_status(self):
        return {"pending_batch_ids": list(range(len(self.steps) * 100, len(self.steps) * 100 + 4))}

    def step(self, train_data, train_data_format):
        self.steps.append(train_data)

    def terminate(self):
        pass


class ReinforcingPolicyLM(PolicyLM):
    def reinforce(self, train_kwargs):
        self.job = FakeReinforceJob()
        return self.job


def test_groups_equal_dspy_grpos_own_on_the_same_traces():
    """dspy.GRPO's grouping (bootstrap_trace_data, then per predictor and example) on the same
    scripted replies, one step, 4 rollouts, rollouts in order on one thread in both. DSPy sends
    re-rendered text for parsed replies, so members compare by parsed fields and reward."""
    policy = ReinforcingPolicyLM(counting_lm(right_on_k1, broken=BROKEN))
    student = KeywordQA()
    student.set_lm(policy)
    from dspy.teleprompt.grpo import GRPO

    grpo = GRPO(
        metric=exact,
        num_threads=1,
        num_train_steps=1,
        num_dspy_examples_per_grpo_step=2,
        num_rollouts_per_grpo_step=4,
        exclude_demos=True,
        variably_invoked_predictor_grouping_mode="truncate",
    )
    with dspy.context(adapter=dspy.ChatAdapter(use_json_adapter_fallback=False)):
        grpo.compile(student, trainset=TRAIN)
    (sent,) = policy.job.steps
    adapter = dspy.ChatAdapter()
    signatures = {n: p.signature for n, p in student.named_predictors()}

    def parsed(member, name):
        try:
            return adapter.parse(signatures[name], member["completion"]["content"])
        except dspy.utils.exceptions.AdapterParseError:
            return None

    theirs = []
    for item in sent:
        group = item["group"]
        name = (
            "keyword"
            if "`keyword`"
            in group[0]["messages"][0]["content"].split("output fields")[1].split("\n")[1]
            else "answer.predict"
        )
        theirs.append(
            (
                name,
                sorted((json.dumps(parsed(m, name), sort_keys=True), m["reward"]) for m in group),
            )
        )
    ours = [
        (
            module,
            sorted((json.dumps(outputs, sort_keys=True), reward) for outputs, _, reward in members),
        )
        for module, _, members in module_groups(
            DSPyProgram(KeywordQA()), dspy_metric(exact), from_dspy_examples(TRAIN)
        )
    ]
    assert len(theirs) == 4 and all(len(members) == 4 for _, members in theirs)
    assert sorted(theirs) == sorted(ours)
    assert any(reward == -1.0 for _, members in ours for _, reward in members)
    assert any(reward == 1.0 for _, members in ours for _, reward in members)


# -- without the extra ----------------------------------------------------------------------------
def test_nothing_imports_dspy_and_the_interop_names_its_extra():
    code = (
        "import sys\n"
        "import mmgrpo_jax, mmgrpo_jax.interop, mmgrpo_jax.trainer.mmgrpo, mmgrpo_jax.cli\n"
        "assert 'dspy' not in sys.modules, 'dspy was imported'\n"
        "sys.modules['dspy'] = None  # as if not installed\n"
        "try:\n"
        "    import mmgrpo_jax.interop.dspy\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == (
        "mmgrpo_jax.interop.dspy needs DSPy (dspy>=3.4,<3.5): pip install -e '.[dspy]'"
    )


# -- training -------------------------------------------------------------------------------------
class DSPyTwoModules(dspy.Module):
    """tests/trainer/test_mmgrpo.py's TwoModules, written in DSPy."""

    def __init__(self):
        super().__init__()
        self.draft = dspy.Predict("question -> draft")
        self.final = dspy.Predict("question, draft -> answer")

    def forward(self, question):
        draft = self.draft(question=question).draft
        return self.final(question=question, draft=draft)


def test_an_unmodified_dspy_program_trains_as_its_native_twin(tmp_path):
    """Three steps on the tiny policy. With BareAdapter the prompts are the native bare
    predictors' byte for byte, so the samples, groups, losses and gradients are the native run's:
    the recorded numbers of its first two steps, and the native program's third step."""
    from flax import nnx

    from mmgrpo_jax.rl.losses import LossConfig
    from mmgrpo_jax.trainer.mmgrpo import MMGRPO
    from models.tokenizer import train_bpe_tokenizer
    from tests.trainer.conftest import CORPUS
    from tests.trainer.test_mmgrpo import RECORDED, TRAIN, VAL, config, new_model, reward, run

    tokenizer = train_bpe_tokenizer(CORPUS, 300, "chatml")
    loss = {"loss": LossConfig("grpo", beta=0.04)}
    native_cfg = config(tmp_path / "native", num_steps=3, **loss)
    native_model, _ = run(tokenizer, native_cfg)

    cfg = config(tmp_path / "dspy", num_steps=3, **loss)
    model = new_model(tokenizer)
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    trainer = MMGRPO(reward, cfg, model=model, tokenizer=tokenizer, stop_token_ids=stop)
    program = DSPyTwoModules()
    to_dspy = [
        dspy.Example(question=e.question, answer=e.answer).with_inputs("question") for e in TRAIN
    ]
    with dspy.context(adapter=BareAdapter()):
        trained = trainer.compile(program, to_dspy, to_dspy[: len(VAL)])

    def logged(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    ours, theirs = logged(tmp_path / "dspy" / "run"), logged(tmp_path / "native" / "run")
    steps = [r for r in ours if "loss" in r]
    assert [r["step"] for r in steps] == [1.0, 2.0, 3.0]
    # step 1's loss is 0 up to float32 rounding (~1e-8, by the layout's summation order), as in
    # test_mmgrpo; the native twin, on the same layout, is matched exactly below
    for key, want in RECORDED["module"].items():
        np.testing.assert_allclose([r[key] for r in steps[:2]], want, rtol=1e-4, atol=1e-7)
    for key in ("loss", "grad_norm", "reward_mean", "eval_reward"):
        assert [r[key] for r in ours if key in r] == [r[key] for r in theirs if key in r], key
    lora = jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))
    native_lora = jax.tree.map(np.asarray, nnx.state(native_model, nnx.LoRAParam))
    jax.tree.map(np.testing.assert_array_equal, lora, native_lora)

    # given back: a DSPy program on the trained policy, saved the DSPy way, and the adapter
    assert isinstance(trained, DSPyTwoModules) and trained is not program
    assert program.draft.lm is None  # the program passed in is left as it was
    policy = trained.draft.lm
    assert isinstance(policy, PolicyLM) and trained.final.lm is policy
    try:
        # called outside any dspy.context, it keeps the format it was trained with: any reply
        # parses under BareAdapter, none of the random policy's under ChatAdapter's headers
        assert dspy.settings.adapter is None
        pred = trained(question=TRAIN[0].question)
        assert isinstance(pred.answer, str)
        assert isinstance(trained.final(question="q", draft="d").answer, str)  # a predictor alone
        rendered = [m["content"] for m in policy.history[-1]["messages"]]
        assert rendered == [
            m["content"]
            for m in BareAdapter().format(
                trained.final.signature, [], {"question": "q", "draft": "d"}
            )
        ]
        with dspy.context(adapter=dspy.ChatAdapter()), pytest.raises(Exception, match="parse"):
            trained(question=TRAIN[0].question)  # a context's adapter wins
    finally:
        policy.close()
    saved = json.loads((tmp_path / "dspy" / "run" / "program.json").read_text())
    assert set(saved) == {"draft", "final", "metadata"}
    assert (tmp_path / "dspy" / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_per_module_adapters_route_dspy_predictors_as_native_ones(tmp_path):
    """Per-module adapters through the bridge: DSPy's predictor names pick the adapters, so two
    steps equal the native twin's with the same modules (numbers and both adapters' weights);
    the program given back has one LM per predictor, each serving its module's adapter."""
    from flax import nnx

    from mmgrpo_jax.rl.losses import LossConfig
    from mmgrpo_jax.testing import tiny_decoder
    from mmgrpo_jax.trainer.mmgrpo import MMGRPO
    from models.tokenizer import train_bpe_tokenizer
    from tests.trainer.conftest import CORPUS
    from tests.trainer.test_mmgrpo import PER_MODULE, TRAIN, VAL, config, reward, run

    tokenizer = train_bpe_tokenizer(CORPUS, 300, "chatml")
    settings = {"loss": LossConfig("grpo", beta=0.04), "lora": PER_MODULE}
    native_model, _ = run(
        tokenizer,
        config(tmp_path / "native", **settings),
        tiny_decoder(len(tokenizer), lora=PER_MODULE),
    )
    model = tiny_decoder(len(tokenizer), lora=PER_MODULE)
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    cfg = config(tmp_path / "dspy", **settings)
    trainer = MMGRPO(reward, cfg, model=model, tokenizer=tokenizer, stop_token_ids=stop)
    to_dspy = [
        dspy.Example(question=e.question, answer=e.answer).with_inputs("question") for e in TRAIN
    ]
    with dspy.context(adapter=BareAdapter()):
        trained = trainer.compile(DSPyTwoModules(), to_dspy, to_dspy[: len(VAL)])

    def logged(run_dir):
        lines = (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    ours, theirs = logged(tmp_path / "dspy"), logged(tmp_path / "native")
    for key in ("loss", "grad_norm", "reward_mean", "eval_reward"):
        assert [r[key] for r in ours if key in r] == [r[key] for r in theirs if key in r], key
    lora = jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))
    jax.tree.map(
        np.testing.assert_array_equal,
        lora,
        jax.tree.map(np.asarray, nnx.state(native_model, nnx.LoRAParam)),
    )
    drafter, finisher = trained.draft.lm, trained.final.lm
    assert isinstance(drafter, PolicyLM) and drafter is not finisher
    try:
        messages = BareAdapter().format(trained.draft.signature, [], {"question": "question 0?"})
        replies = {lm.policy_engine.policy()(messages).completion_ids for lm in (drafter, finisher)}
        assert len(replies) == 2  # the two adapters answer the same prompt differently
        with dspy.context(adapter=BareAdapter()):
            assert isinstance(trained(question=TRAIN[0].question).answer, str)
    finally:
        drafter.close()
        finisher.close()
    with pytest.raises(ValueError, match=r"adapter_name='nope' is not one of .*'drafter'"):
        PolicyLM.local(model, tokenizer, stop, adapter_name="nope")


def test_a_saved_program_loads_its_policy_and_adapter_back(tmp_path):
    from mmgrpo_jax.engines.base import Sampling
    from mmgrpo_jax.engines.lm import EngineLM
    from models.export import save_peft_adapter
    from models.hf import load_checkpoint
    from models.lora import LoRAConfig
    from models.tiny_checkpoint import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    model, tokenizer, stop = load_checkpoint(
        checkpoint, dtype=np.float32, lora=LoRAConfig(rank=2, alpha=4.0), lora_seed=3
    )
    for _, leaf in nnx_lora_leaves(model):  # an adapter that changes the replies
        leaf[...] = leaf[...] + 0.5
    save_peft_adapter(model, tmp_path / "adapter")
    direct = EngineLM.local(model, tokenizer, sampling=Sampling(6, 0.0), stop_token_ids=stop)
    try:
        messages = BareAdapter().format(
            dspy.Predict("question -> answer").signature, [], {"question": "Capital of Peru?"}
        )
        want = direct(messages).text.strip()
    finally:
        direct.close()

    program = dspy.Predict("question -> answer")
    program.set_lm(PolicyLM.from_pretrained(checkpoint, adapter=tmp_path / "adapter", max_tokens=6))
    program.save(str(tmp_path / "program.json"))
    loaded = dspy.Predict("question -> answer")
    loaded.load(str(tmp_path / "program.json"), allow_unsafe_lm_state=True)
    assert isinstance(loaded.lm, PolicyLM)
    try:
        with dspy.context(adapter=BareAdapter()):
            assert loaded(question="Capital of Peru?").answer == want
    finally:
        loaded.lm.close()
    with pytest.raises(ValueError, match="allow_unsafe_lm_state"):
        dspy.Predict("question -> answer").load(str(tmp_path / "program.json"))


def nnx_lora_leaves(model):
    from flax import nnx

    return nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))


def echo_schema_lm(seed=0):
    """Replies with every output field the system message asks for: any DSPy signature parses."""
    import random

    rng = random.Random(seed)

    def respond(messages):
        fields = re.search(r"Your output fields are:\n(.*?)\n\n", messages[0]["content"], re.S)
        names = re.findall(r"^\d+\. `(\w+)`", fields.group(1), re.M)
        values = {n: rng.choice(["Paris", "Lima"]) if n == "answer" else f"{n}?" for n in names}
        return headed(**values)

    return ScriptedLM(respond, token_ids=True)


class QA(dspy.Module):
    def __init__(self):
        super().__init__()
        self.answer = dspy.Predict("question -> answer")

    def forward(self, question):
        return self.answer(question=question)


def test_dspy_optimizers_run_on_a_policy_lm_and_their_program_trains():
    data = [
        dspy.Example(question=f"capital {i}?", answer=["Lima", "Paris"][i % 2]).with_inputs(
            "question"
        )
        for i in range(10)
    ]
    policy = PolicyLM(echo_schema_lm())
    with dspy.context(lm=policy):
        few_shot = dspy.BootstrapFewShot(metric=exact, max_bootstrapped_demos=2).compile(
            QA(), trainset=data[:6]
        )
        mipro = dspy.MIPROv2(
            exact,
            prompt_model=policy,
            task_model=policy,
            auto=None,
            num_candidates=2,
            num_threads=1,
            verbose=False,
        ).compile(
            QA(),
            trainset=data[:6],
            valset=data[6:],
            num_trials=2,
            minibatch=False,
            max_bootstrapped_demos=1,
            max_labeled_demos=1,
        )
    assert few_shot.answer.demos  # bootstrapped from replies the metric accepted
    for optimized in (few_shot, mipro):  # their prompts are what the rollouts sample from
        (trajectory,) = run_rollouts(
            DSPyProgram(optimized),
            from_dspy_examples(data[:1]),
            dspy_metric(exact),
            num_rollouts=1,
            lm=echo_schema_lm(),
        )
        (call,) = trajectory.calls
        assert call.messages[0]["content"].count(optimized.answer.signature.instructions) == 1
        assert len(call.messages) == 2 + 2 * len(optimized.answer.demos)


def test_several_replies_per_call_are_refused_in_a_rollout():
    class Many(dspy.Module):
        def __init__(self):
            super().__init__()
            self.answer = dspy.Predict("question -> answer", n=2)

        def forward(self, question):
            return self.answer(question=question)

    lm = ScriptedLM(lambda m: headed(answer="x"), token_ids=True)
    (trajectory,) = run_rollouts(
        DSPyProgram(Many()),
        from_dspy_examples(TRAIN[:1]),
        lambda e, p: 1.0,
        num_rollouts=1,
        lm=lm,
    )
    assert trajectory.status == "error"
    assert "second LM call in one call" in trajectory.error


def test_truncated_replies_are_not_warned_about_in_rollouts_only(caplog):
    from mmgrpo_jax.program.lm import LMOutput

    def cut(messages, **sampling):
        return LMOutput(headed(keyword="k"), (1, 2), (3, 4), (-0.1, -0.2), "length")

    run_rollouts(
        DSPyProgram(AskTwice()),
        from_dspy_examples(TRAIN[:1]),
        lambda e, p: 1.0,
        num_rollouts=2,
        lm=cut,
    )
    assert "truncated" not in caplog.text
    with dspy.context(lm=PolicyLM(cut)):
        dspy.Predict("question -> keyword")(question="q")
    assert "LM response was truncated" in caplog.text


def test_a_dspy_program_that_mutates_itself_in_forward_is_refused(tmp_path):
    """Demos appended in forward ran up to 14 on the program passed in over two steps, each
    rollout seeing the others'; now the first step's rollouts are the last."""
    from mmgrpo_jax.trainer.mmgrpo import MMGRPO
    from models.tokenizer import train_bpe_tokenizer
    from tests.trainer.conftest import CORPUS
    from tests.trainer.test_mmgrpo import TRAIN, config, new_model, reward

    class SelfTeaching(dspy.Module):
        def __init__(self):
            super().__init__()
            self.draft = dspy.Predict("question -> answer")

        def forward(self, question):
            self.draft.demos.append(dspy.Example(question=question, answer="x"))
            return self.draft(question=question)

    tokenizer = train_bpe_tokenizer(CORPUS, 300, "chatml")
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    cfg = config(tmp_path, eval_every=100)
    trainer = MMGRPO(
        reward, cfg, model=new_model(tokenizer), tokenizer=tokenizer, stop_token_ids=stop
    )
    data = [
        dspy.Example(question=e.question, answer=e.answer).with_inputs("question") for e in TRAIN
    ]
    with (
        dspy.context(adapter=BareAdapter()),
        pytest.raises(UserError, match=r"changed its own predictors \['draft'\]"),
    ):
        trainer.compile(SelfTeaching(), data, ())
