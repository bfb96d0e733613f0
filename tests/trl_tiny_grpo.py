"""Two GRPO steps with TRL on CPU, rewarded by genrm-trio: the program ``tests/test_trl.py`` runs,
as one process (``python3 tests/trl_tiny_grpo.py ...``) or two (``accelerate launch
--num_processes 2 --cpu tests/trl_tiny_grpo.py ...``).

Nothing comes from a hub: the tokenizer is a word-level ``tokenizers`` vocabulary with a chat
template, built here; the model is a randomly initialised one-layer Llama with tiny dimensions.
Every process writes ``<out>/process<index>.json``: the rewards its :class:`GenRMReward` returned
per call, every ``/verify`` answer it received (recorded by its transport, before the hook maps
them) and, on process 0, the trainer's ``log_history``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx2

from genrm_trio.integrations.trl import GenRMReward

WORDS = ["add", "two", "and", "three", "four", "five", "six", "seven", "is", "the", "sum",
         "answer", "yes", "no", "maybe", "big", "small", "red", "blue", "one", "ten", "zero"]
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


class Recording(httpx2.AsyncBaseTransport):
    """httpx2's own transport, keeping every ``/verify`` answer body."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.answers = answers

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/verify"):
            body = await response.aread()
            self.answers.append({"status": response.status_code, **json.loads(body)})
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *ROLES, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", additional_special_tokens=ROLES)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--per-device", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tok = tokenizer()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id))
    prompts = [[{"role": "user", "content": f"add {WORDS[i % 8]} and {WORDS[(i * 3) % 8]}"}]
               for i in range(args.prompts)]
    answers: list[dict[str, Any]] = []
    returned: list[list[float | None]] = []

    class Recorded(GenRMReward):
        """GenRMReward itself, keeping what each call returned to TRL."""

        async def __call__(self, *args: Any, **kwargs: Any) -> list[float | None]:
            out = await super().__call__(*args, **kwargs)
            returned.append(out)
            return out

    reward = Recorded(args.url, num_generations=4, max_connections=16,
                      transport_factory=lambda: Recording(answers))
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"), per_device_train_batch_size=args.per_device,
        num_generations=4, max_completion_length=6, max_steps=args.steps, logging_steps=1,
        learning_rate=1e-3, beta=0.0, report_to="none", use_cpu=True, save_strategy="no",
        seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False, fp16=False)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    index = trainer.accelerator.process_index
    record = {"process_index": index, "num_processes": trainer.accelerator.num_processes,
              "run_id": reward.run_id, "returned": returned, "answers": answers,
              "log_history": trainer.state.log_history if index == 0 else None}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"process{index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
