"""Shared fixtures: tiny random Llama / Qwen3 targets built here, the real SmolLM2 target (offline), and
briefly trained drafters for each."""

from __future__ import annotations

import contextlib
import json
import os
import random
import urllib.request

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from dspine.drafter import DSpineDraftModel  # noqa: E402
from dspine.engine import Engine  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from dspine.target import Target, load_target  # noqa: E402
from dspine.train.loop import TrainConfig, train_drafter  # noqa: E402

METHODS = ("dflash", "post_backbone", "dspine")


def tiny_target(
    arch: str,
    vocab: int = 128,
    hidden: int = 64,
    layers: int = 6,
    head_scale: float = 1.0,
    seed: int = 0,
    dtype=torch.float32,
) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **kw))
    else:
        raise ValueError(arch)
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return Target(model.to(dtype), None, name=f"tiny-{arch}")


def perturb_writes(drafter: DSpineDraftModel, std: float = 0.2, seed: int = 0) -> DSpineDraftModel:
    """An 'untrained' drafter whose injection writes are non-zero, so the injection path is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for inj in drafter.injections.values():
            inj.write.weight.copy_(torch.randn(inj.write.weight.shape, generator=g) * std)
    return drafter


def regen_pairs(target: Target, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], int]]:
    eng = Engine(target)
    out = []
    for p in prompts:
        r = eng.generate(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        out.append((list(p) + r.token_ids, len(p)))
    return out


def _watched_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(("DSPINE_", "RAY_ADDRESS")) or k == "PYTHONPATH"}


@pytest.fixture(autouse=True)
def environment_kept():
    """A test (or the code it drives in this process) that leaves a key, a Ray address or the checkout on
    PYTHONPATH in the environment changes what every later test's servers and subprocesses see: it fails here,
    and the environment is put back."""
    before = _watched_env()
    yield
    after = _watched_env()
    if after != before:
        for k in set(after) - set(before):
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        pytest.fail(f"the test left the environment changed: {changed}")


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny(request):
    """(target, training pairs) for a tiny random target of each architecture."""
    t = tiny_target(request.param)
    rng = random.Random(0)
    prompts = [[rng.randrange(t.info.vocab_size) for _ in range(6)] for _ in range(24)]
    return t, regen_pairs(t, prompts, 40)


def brief_train(drafter, target, pairs, steps=40, **kw):
    cfg = TrainConfig(
        steps=steps, batch_size=4, anchors_per_seq=6, gamma=4.0, warmup_steps=5, lr=2e-3, eval_every=10**9, **kw
    )
    train_drafter(drafter, target, pairs, cfg, progress=False)
    return drafter


@pytest.fixture(scope="session")
def smollm2():
    return load_target("smollm2-135m-instruct", dtype=torch.float32)


CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the factorial of n.",
    "List three tips for staying focused while studying.",
    "Explain photosynthesis to a ten-year-old.",
    "What is 17 times 23? Show your steps.",
]


@pytest.fixture(scope="session")
def smollm2_pairs(smollm2):
    from dspine.workloads import load_prompts

    prompts = load_prompts("sharegpt", limit=6, max_chars=300)
    eng = Engine(smollm2)
    return [
        (ids + eng.generate(ids, SamplingParams(max_tokens=48)).token_ids, len(ids))
        for ids in (eng.prompt_ids(p) for p in prompts)
    ]


@pytest.fixture(scope="session")
def smollm2_drafters(smollm2, smollm2_pairs):
    """method -> (untrained with non-zero writes, briefly trained) small drafters for the real target."""
    out = {}
    for m in METHODS:
        fresh = perturb_writes(DSpineDraftModel.for_target(smollm2, method=m, num_hidden_layers=2, seed=1))
        trained = DSpineDraftModel.for_target(smollm2, method=m, num_hidden_layers=2, seed=2)
        brief_train(trained, smollm2, smollm2_pairs, steps=6)
        out[m] = (fresh, trained)
    return out


READ_KEY = "sk-dspine-read-key"  # the test servers' read key (their records and drafter reads)


def read_json_url(url: str, key: str | None = READ_KEY):
    """GET a dspine serve URL with the read key -> its JSON."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def running_server(ckpt, name: str = "smol", max_prompt_tokens: int = 200):
    """The real `dspine serve` on a free 127.0.0.1 port (SmolLM2 + the given drafter); yields its base URL."""
    from dspine.serve.server import start_server_process  # the serving extras (pydantic, fastapi) only here

    extra = ["--max-prompt-tokens", str(max_prompt_tokens)]
    proc, base = start_server_process(ckpt, name, extra=extra, env={"DSPINE_READ_KEY": READ_KEY})
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory, smollm2_drafters):
    """`dspine serve` (SmolLM2 + a briefly trained small drafter) taking agent-length prompts: its /v1 URL."""
    from dspine.checkpoint import save_drafter

    ckpt = save_drafter(smollm2_drafters["dspine"][1], tmp_path_factory.mktemp("agents") / "dspine")
    with running_server(ckpt, "smol", max_prompt_tokens=8000) as base:
        yield base + "/v1"
