"""veRL 0.9.1's own reward code scoring against genrm-trio (run by ``tests/test_verl.py`` with the
Python that has veRL; writes one JSON file and exits).

Nothing comes from a hub: the tokenizer is a word-level ``tokenizers`` vocabulary saved to a
temporary directory, which the config names as the model (veRL's worker loads its tokenizer
from ``actor_rollout_ref.model.path``). The config is veRL's own ``ppo_trainer.yaml``, composed
with Hydra and the overrides a user passes on the command line. The batch is built the way
veRL's trainer builds it: one uuid4 per prompt row, ``DataProto.repeat(n, interleave=True)``,
then the generated tensors unioned in.

Modes:

- ``loop``: two ``RewardLoopWorker`` objects (``reward.num_workers=2``; veRL wraps the class
  in a Ray actor, here it is built as is) load the manager from the config; the batch, shuffled
  with ``DataProto.reorder`` so that groups straddle the workers, is padded and chunked as
  ``RewardLoopManager.compute_rm_score`` does (``pad_dataproto_to_divisor``,
  ``DataProto.chunk``), each chunk scored by its worker's ``compute_score_batch`` (one task per
  sample), both at once on one asyncio loop, and the scores put in place by the loaded class's
  ``assemble_rm_scores``. Then the mock judge is switched to garbage verdicts and a second
  batch is scored the same way (a masked cohort), and the fault switched off again.
- ``legacy``: ``GenRMRewardManager`` loaded with veRL's ``load_extern_object``, built with the
  legacy keyword arguments, called with ``return_dict=True`` on a batch reordered by veRL's
  own ``RayPPOTrainer._balance_batch`` (two data-parallel ranks).
- ``pool``: one worker, on a loop whose default executor has 32 threads (veRL's bound on a
  machine with 28 or more cores), scores ``--prompts`` x n samples at once, in slot-major
  order (no group complete among the first 32): more members waiting than threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import types
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

WORDS = ["the", "sky", "is", "blue", "grass", "green", "water", "wet", "fire", "hot", "none",
         "None", "why", "what", "colour", "answer", "short", "long", "very", "really", "quite"]


def save_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.save_pretrained(str(path))
    return tok


def compose(tok_dir: Path, url: str, n: int, extra: list[str]) -> Any:
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        f"actor_rollout_ref.model.path={tok_dir}",
        f"actor_rollout_ref.rollout.n={n}",
        "reward.reward_manager.source=importlib",
        "reward.reward_manager.name=GenRMRewardLoopManager",
        "reward.reward_manager.module.path=pkg://genrm_trio.integrations.verl",
        f"+reward.reward_kwargs.genrm_url={url}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        *extra,
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def build_batch(tok: Any, prompts: list[str], responses: list[list[str]], n: int) -> Any:
    """A trainer-shaped batch: uids per prompt row, repeated n times interleaved, then the
    generated tensors (left-padded prompts, right-padded responses) joined to them."""
    import numpy as np
    import torch
    from verl import DataProto

    raw_prompt = np.empty(len(prompts), dtype=object)
    raw_prompt[:] = [[{"role": "user", "content": p}] for p in prompts]
    rows = DataProto.from_dict(non_tensors={
        "raw_prompt": raw_prompt,
        "data_source": np.array(["genrm"] * len(prompts), dtype=object),
        "reward_model": np.array([{"ground_truth": None}] * len(prompts), dtype=object),
    })
    rows.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in prompts], dtype=object)
    repeated = rows.repeat(repeat_times=n, interleave=True)
    prompt_ids = [tok.encode(p) for p in prompts for _ in range(n)]
    response_ids = [tok.encode(r) + [tok.eos_token_id] for group in responses for r in group]
    width_p = max(map(len, prompt_ids))
    width_r = max(map(len, response_ids)) + 2
    pad = tok.pad_token_id
    p = torch.tensor([[pad] * (width_p - len(x)) + x for x in prompt_ids])
    r = torch.tensor([x + [pad] * (width_r - len(x)) for x in response_ids])
    p_mask = torch.tensor([[0] * (width_p - len(x)) + [1] * len(x) for x in prompt_ids])
    r_mask = torch.tensor([[1] * len(x) + [0] * (width_r - len(x)) for x in response_ids])
    attention = torch.cat([p_mask, r_mask], dim=1)
    generated = DataProto.from_dict(tensors={
        "prompts": p, "responses": r, "input_ids": torch.cat([p, r], dim=1),
        "attention_mask": attention, "position_ids": torch.cumsum(attention, dim=1) - 1})
    # The rows here carry no tensors (veRL's carry the dataset's input ids), so the union is
    # the generated tensors with the repeated rows' fields.
    return DataProto(batch=generated.batch, non_tensor_batch=repeated.non_tensor_batch)


def rows_of(data: Any, tok: Any, rm: Any, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """What the test checks, per row in the batch's order: uid, response text, where the
    score sits and its value, the reward_extra_info."""
    out = []
    prompt_len = data.batch["prompts"].shape[1]
    for i in range(len(data)):
        valid = int(data.batch["attention_mask"][i, prompt_len:].sum())
        nonzero = [int(j) for j in (rm[i] != 0).nonzero().flatten()]
        out.append({
            "uid": str(data.non_tensor_batch["uid"][i]),
            "response": tok.decode(data.batch["responses"][i][:valid], skip_special_tokens=True),
            "valid_response_length": valid, "nonzero": nonzero,
            "score": float(rm[i].sum()),
            "extra": {k: (v[i].item() if hasattr(v[i], "item") else v[i])
                      for k, v in extra.items()},
        })
    return out


async def score_with_workers(workers: list[Any], data: Any, manager_cls: Any) -> tuple[Any, Any]:
    """As RewardLoopManager.compute_rm_score: pad, chunk per worker, score every chunk at once,
    unpad, assemble with the manager class's own assemble_rm_scores."""
    import numpy as np
    from verl.protocol import pad_dataproto_to_divisor

    padded, pad_size = pad_dataproto_to_divisor(data, len(workers))
    chunks = padded.chunk(len(workers))
    outputs = await asyncio.gather(*(w.compute_score_batch(c) for w, c in
                                     zip(workers, chunks, strict=True)))
    flat = [o for chunk in outputs for o in chunk][: len(data)]
    rm = manager_cls.assemble_rm_scores(data, [o["reward_score"] for o in flat])
    infos = [o.get("reward_extra_info", {}) for o in flat]
    extra = {k: np.array([info[k] for info in infos]) for k in infos[0]}
    return rm, extra


def set_judge_fault(judge_url: str, fault: str) -> None:
    body = json.dumps({"fault": fault, "count": None}).encode()
    request = urllib.request.Request(judge_url.rstrip("/") + "/admin/fault", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200, answer.status


GOOD = [["the sky is blue", "the sky is really blue", "None", "blue the sky is very blue"],
        ["grass is green", "None", "the grass is quite green", "green grass is very green"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["loop", "legacy", "pool"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--judge-url", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--prompts", type=int, default=12)
    args = parser.parse_args()
    n = 4
    args.out.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(args.out / "tokenizer")

    from verl.experimental.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    result: dict[str, Any] = {"mode": args.mode}
    if args.mode == "loop":
        config = compose(args.out / "tokenizer", args.url, n, ["reward.num_workers=2"])
        manager_cls = resolve_reward_manager_cls(config)
        result["manager_class"] = f"{manager_cls.__module__}.{manager_cls.__qualname__}"
        workers = [RewardLoopWorker(config) for _ in range(config.reward.num_workers)]
        data = build_batch(tok, ["why is the sky blue", "what colour is grass"], GOOD, n)
        order = [0, 5, 2, 7, 4, 1, 6, 3]  # groups straddle the two workers' chunks
        data.reorder(__import__("torch").tensor(order))
        rm, extra = asyncio.run(score_with_workers(workers, data, manager_cls))
        result["rows"] = rows_of(data, tok, rm, extra)
        set_judge_fault(args.judge_url, "garbage")
        try:
            masked = build_batch(tok, ["why is fire hot"], [["fire is hot", "very hot",
                                                            "None", "fire is really hot"]], n)
            rm, extra = asyncio.run(score_with_workers(workers, masked, manager_cls))
            result["masked_rows"] = rows_of(masked, tok, rm, extra)
        finally:
            set_judge_fault(args.judge_url, "none")
    elif args.mode == "legacy":
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from verl.utils.import_utils import load_extern_object

        manager_cls = load_extern_object("pkg://genrm_trio.integrations.verl",
                                         "GenRMRewardManager")
        result["manager_class"] = f"{manager_cls.__module__}.{manager_cls.__qualname__}"
        manager = manager_cls(tokenizer=tok, num_examine=0, compute_score=None,
                              reward_fn_key="data_source", genrm_url=args.url)
        data = build_batch(tok, ["why is the sky blue", "what colour is grass"], GOOD, n)

        def keys() -> list[tuple[str, str]]:
            return [(str(u), tok.decode(r, skip_special_tokens=True)) for u, r in
                    zip(data.non_tensor_batch["uid"], data.batch["responses"], strict=True)]

        before = keys()
        # The trainer's own balancing (two data-parallel ranks), on the trainer's method.
        stub = types.SimpleNamespace(_get_dp_size=lambda worker_group, role: 2,
                                     actor_rollout_wg=None, use_prefix_grouper=False)
        RayPPOTrainer._balance_batch(stub, data, metrics={})
        result["permutation"] = [before.index(k) for k in keys()]
        out = manager(data, return_dict=True)
        result["rows"] = rows_of(data, tok, out["reward_tensor"], {
            k: __import__("numpy").array(v) for k, v in out["reward_extra_info"].items()})
    else:
        config = compose(args.out / "tokenizer", args.url, n, ["reward.num_workers=1"])
        manager_cls = resolve_reward_manager_cls(config)
        worker = RewardLoopWorker(config)
        words = ["sky", "blue", "grass", "green", "water", "wet", "fire", "hot"]
        prompts = [f"why {words[k % 8]} {words[(k + 3) % 8]} {k % 5 * 'very '}".strip()
                   for k in range(args.prompts)]
        responses = [[f"{words[(k + j) % 8]} is {'really ' * j}{words[k % 8]}"
                      for j in range(n)] for k in range(args.prompts)]
        data = build_batch(tok, prompts, responses, n)
        # Slot-major, as a balanced batch can be: every group's first sample, then every
        # second one...: the first 32 samples complete no group.
        data.reorder(__import__("torch").tensor(
            [k * n + j for j in range(n) for k in range(args.prompts)]))

        async def scored() -> tuple[Any, Any]:
            loop = asyncio.get_running_loop()
            executor = ThreadPoolExecutor(max_workers=32)
            loop.set_default_executor(executor)
            result["executor_threads"] = executor._max_workers
            return await asyncio.wait_for(score_with_workers([worker], data, manager_cls),
                                          timeout=300)

        rm, extra = asyncio.run(scored())
        result["rows"] = rows_of(data, tok, rm, extra)
    (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
