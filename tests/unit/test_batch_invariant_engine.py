"""The engine's batch-invariant mode (issue 42): a request's tokens, logprobs, top logprobs, kept
mass and routed experts are the same, compared with ==, whatever else runs beside it.

The reference is never taken from the code under test's other paths: it is the same request
run alone (a cold cache, a batch of one, no chunking, serial scheduling, eager), and every
variant (mixed batches with staggered arrivals, chunked prefill at two budgets, prefix hits, a
KV budget tight enough to preempt, async scheduling, graph replay, n-gram speculation, n > 1
with seeded sampling) must equal it exactly. What the mode refuses (an attention backend
other than the C kernel) is checked to be refused with a reason.
"""

from __future__ import annotations

import random

import pytest
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

from tests.tiny_models import (
    make_gemma3,
    make_gpt_oss,
    make_qwen3_5,
    make_qwen3_5_moe,
    make_qwen3_next,
)

# (fixture, what it captures per token): dense, MoE (softmax and sigmoid grouped routing), MLA,
# linear-attention hybrids (Gated DeltaNet: dense, every layer MoE, Qwen3-Next's fused
# projections with dense and MoE layers), sliding windows beside full layers (Gemma3's window
# 13, off the kernel's chunk width; gpt-oss's 8 with sinks), DSA (DeepSeek-V3.2; GLM-5's
# shared indexers)
FAMILIES = [
    ("tiny_llama_dir", ()),
    ("tiny_qwen3_dir", ()),
    ("tiny_moe_dir", ("routed_experts",)),
    ("tiny_glm4_moe_dir", ("routed_experts",)),
    ("tiny_deepseek_dir", ("routed_experts",)),
    ("tiny_qwen3_5_dir", ()),
    ("tiny_qwen3_5_moe_dir", ("routed_experts",)),
    ("tiny_qwen3_next_dir", ("routed_experts",)),
    ("tiny_gemma3_dir", ()),
    ("tiny_gpt_oss_dir", ("routed_experts",)),
    ("tiny_dsa_dir", ("routed_experts", "indexer_topk")),
    ("tiny_glm5_dir", ("routed_experts", "indexer_topk")),
]
DTYPES = ["float32", "bfloat16"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False}
MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny_qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_qwen3_5(tmp_path_factory.mktemp("bi_qwen3_5"))


@pytest.fixture(scope="module")
def tiny_qwen3_5_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_qwen3_5_moe(tmp_path_factory.mktemp("bi_qwen3_5_moe"))


@pytest.fixture(scope="module")
def tiny_qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_qwen3_next(tmp_path_factory.mktemp("bi_qwen3_next"))


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_gemma3(tmp_path_factory.mktemp("bi_gemma3"), sliding_window=13)


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_gpt_oss(tmp_path_factory.mktemp("bi_gpt_oss"))


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Six prompts of 5 to 63 tokens; every other one shares a 20-token prefix (prefix hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    prompts = []
    for i, n in enumerate([9, 23, 40, 5, 31, 17]):
        body = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(shared + body if i % 2 else body)
    return prompts


def engine_for(model_dir: str, dtype: str, **kw) -> LLMEngine:
    # hybrids: a state snapshot for every prompt and finished request (the default, one per
    # state slot, evicts the prompts' before their second pass could hit them)
    kw = {"block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 8, "num_state_snapshots": 16, **kw}
    return LLMEngine(EngineConfig(model=model_dir, dtype=dtype, batch_invariant=True, **kw))


def run(engine: LLMEngine, prompts, params, stagger: int = 0) -> list:
    """Outputs in prompt order; with `stagger`, one request joins every `stagger` steps (or
    when the engine runs dry), so prefill chunks share steps with other rows' decodes."""
    done, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        while pending and (
            not stagger or step % stagger == 0 or not engine.has_unfinished_requests()
        ):
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
            if stagger:
                break
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        step += 1
    return [done[i] for i in range(len(prompts))]


def observed(out) -> list[tuple]:
    """Everything the mode promises about a request, per sample, as plain comparable data."""
    return [
        (
            c.token_ids,
            c.logprobs,
            c.top_logprobs,
            c.kept_mass_logprobs,
            None if c.routed_experts is None else c.routed_experts.tolist(),
            None if c.indexer_topk is None else c.indexer_topk.tolist(),
        )
        for c in out.outputs
    ]


def assert_same(reference: list, got: list) -> None:
    for i, (ref, out) in enumerate(zip(reference, got)):
        assert observed(out) == observed(ref), f"request {i} differs from its run alone"


class Family:
    """One (model, dtype): its prompts, params and each request's run alone."""

    def __init__(self, model_dir: str, captures: tuple[str, ...], dtype: str) -> None:
        self.model_dir, self.dtype, self.captures = model_dir, dtype, captures
        self.extra = {f"enable_return_{c}": True for c in captures}
        serial = {"async_scheduling": False, "enable_prefix_caching": False}
        alone = self.engine(max_num_batched_tokens=512, max_num_seqs=1, **serial)
        self.prompts = make_prompts(alone.validator.vocab_size)
        self.kv_groups = len(alone.block_manager.windows)  # sliding layers' tables apart
        self.greedy = self.params(temperature=0.0)
        self.sampled = self.params(temperature=0.8, top_p=0.9, seed=7, n=2)
        self.ref_greedy = self.reference(alone, self.greedy)
        self.ref_sampled = self.reference(alone, self.sampled)
        # a step that raises ends every request alike ("error"): equal, and proving nothing
        for out in self.ref_greedy + self.ref_sampled:
            assert all(c.finish_reason == "length" for c in out.outputs), out.error

    def params(self, **kw) -> SamplingParams:
        return SamplingParams(
            max_tokens=MAX_NEW,
            ignore_eos=True,
            logprobs=3,
            return_kept_mass=True,
            **{f"return_{c}": True for c in self.captures},
            **kw,
        )

    def reference(self, alone: LLMEngine, params: SamplingParams) -> list:
        """Each request alone: a cold cache, a batch of one, one prefill chunk, serial."""
        outs = []
        for prompt in self.prompts:
            alone.flush_cache()
            outs.append(run(alone, [prompt], params)[0])
        return outs

    def engine(self, **kw) -> LLMEngine:
        return engine_for(self.model_dir, self.dtype, **self.extra, **kw)


@pytest.fixture(
    scope="module",
    params=[(f, captures, d) for f, captures in FAMILIES for d in DTYPES],
    ids=[
        f"{f.removeprefix('tiny_').removesuffix('_dir')}-{d}" for f, _ in FAMILIES for d in DTYPES
    ],
)
def family(request) -> Family:
    name, captures, dtype = request.param
    return Family(request.getfixturevalue(name), captures, dtype)


@pytest.mark.parametrize("budget", [16, 40])
def test_mixed_batches_chunked_and_prefix_hits_equal_alone(family: Family, budget: int):
    # async scheduling on (the default), the prefix cache on: the second pass hits it
    engine = family.engine(max_num_batched_tokens=budget)
    for stagger in (0, 2):
        assert_same(family.ref_greedy, run(engine, family.prompts, family.greedy, stagger))
    hits = run(engine, family.prompts, family.greedy, stagger=3)
    # sliding groups: a hit also needs the window's blocks in every group, which the first
    # passes leave cached for some prompts only (as without the mode)
    windowed = any(w is not None for w in engine.block_manager.windows)
    assert (any if windowed else all)(o.num_cached_tokens > 0 for o in hits)
    assert_same(family.ref_greedy, hits)


def test_serial_graph_replay_and_ngram_verify_equal_alone(family: Family):
    # verify rows (k + 1 positions) must equal the decode rows of the run alone
    engine = family.engine(
        max_num_batched_tokens=24,
        async_scheduling=False,
        enforce_eager=False,
        speculative_config=NGRAM,
    )
    assert_same(family.ref_greedy, run(engine, family.prompts, family.greedy, stagger=2))
    assert engine.stats.spec_decode_num_draft_tokens > 0


def test_preemption_and_recompute_equal_alone(family: Family):
    # the longest request fits, the six together do not; sliding groups free blocks as they
    # go, so models with them take fewer blocks per group and smaller chunks to be pushed out
    tight = (32, 30) if family.kv_groups == 1 else (16, 15 * family.kv_groups)
    engine = family.engine(max_num_batched_tokens=tight[0], num_kv_blocks=tight[1])
    got = run(engine, family.prompts, family.greedy)
    assert engine.scheduler.num_preemptions > 0
    assert_same(family.ref_greedy, got)


def test_seeded_sampling_at_n_2_equals_alone(family: Family):
    engine = family.engine(max_num_batched_tokens=16, enforce_eager=False)
    for stagger in (0, 2):
        assert_same(family.ref_sampled, run(engine, family.prompts, family.sampled, stagger))
    # it sampled: a request's two samples part somewhere
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in family.ref_sampled)


def test_an_attention_backend_other_than_the_c_kernel_is_refused(tiny_gemma3_dir):
    with pytest.raises(ValueError, match="attention_backend: 'torch' is not batch invariant"):
        engine_for(tiny_gemma3_dir, "float32", attention_backend="torch")


def test_default_bfloat16_engine_is_not_batch_invariant(smollm2_dir):
    """Without the mode a request's logprobs move with its batch: the property is not free."""
    engine = LLMEngine(
        EngineConfig(model=smollm2_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=8)
    )
    prompts = [
        "The capital of France is",
        "Write a poem about the sea and",
        "1, 2, 3, 4,",
        "Once upon a time there",
        "def fib(n):",
        "The quick brown fox",
        "In 1492, Columbus",
        "Python is a language that",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    batch = engine.generate(prompts, params, use_tqdm=False)
    differ = 0
    for prompt, together in zip(prompts, batch):
        engine.flush_cache()
        alone = engine.generate([prompt], params, use_tqdm=False)[0]
        differ += observed(alone) != observed(together)
    assert differ > 0
