"""The offline API, as vLLM users know it: LLM(...).generate(prompts, sampling_params)."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property

from pageserve.runtime import startup
from pageserve.runtime.engine import LLMEngine
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.lora.request import LoRARequest
from pageserve.runtime.outputs import Logprob, RequestOutput
from pageserve.sampling.params import RequestOutputKind, SamplingParams

# a string, token ids, or a dict {"prompt" or "prompt_token_ids", optional "cache_salt", and
# "multi_modal_data": {"image": a PIL image or a list}, whose prompt has a placeholder per image}
Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        startup.reset()  # a server's start-up cut short in this process does not stop this one
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self.engine.grammar.wait_counts = False  # a batch's grammars all compile, however many wait

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """lora_request: the adapter every prompt runs under, or one per prompt (None: the base
        model); the engine needs enable_lora=True. priority: one per prompt, the lowest first
        (the engine needs scheduling_policy="priority")."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        sampling_params = [replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in sampling_params]
        loras = lora_request if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        for lora in dict.fromkeys(x for x in loras if x is not None):
            self.engine.add_lora(lora)
        # every prompt is checked before any enters the engine, so a bad one leaves no debris
        checked = []
        for i, (p, sp, lora, prio) in enumerate(zip(prompts, sampling_params, loras, priority)):
            try:
                prompt, salt, images = _unpack(p)
                checked.append(replace(self._process(prompt, sp, salt, images, prio), lora=lora))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return self._run([self.engine.add_processed(c) for c in checked], use_tqdm)

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], use_tqdm: bool = True) -> list[RequestOutput]:
        """Each prompt's embedding (`RequestOutput.embedding`), as /v1/embeddings gives it: the
        last hidden states pooled as the model's pooler says (runtime/pooling.py)."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        checked = []
        for i, p in enumerate(prompts):
            try:
                checked.append(self.engine.inputs.process_embedding(p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return self._run([self.engine.add_processed(c) for c in checked], use_tqdm)

    def _process(self, prompt, params: SamplingParams, salt: str | None, images, priority: int):
        if images is None:
            return self.engine.inputs.process(prompt, params, salt, priority=priority)
        if self.engine.images is None:
            raise ValueError(f"{self.engine.config.model.architecture} takes no images")
        if not isinstance(prompt, str):
            raise ValueError("a prompt with multi_modal_data is text, with the model's image placeholder per image")
        images = images if isinstance(images, (list, tuple)) else [images]
        ids, items = self.engine.images.process(prompt, list(images))
        return self.engine.inputs.process(ids, params, salt, mm_items=items, prompt_text=prompt, priority=priority)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ValueError("the model has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        # the objects from before the loop (torch, the model, the prompts) sit out the garbage
        # collections during it: a full one traverses them all, 0.2 s with a model loaded
        gc.freeze()
        try:
            while len(results) < len(ids):
                outputs = self.engine.step()
                for rid, error in self.engine.take_failures():
                    if rid in wanted:
                        raise error
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            self.engine.collect_in_flight()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            gc.unfreeze()
            if bar is not None:
                bar.close()
        return [self._vllm_logprobs(results[rid]) for rid in ids]

    def _vllm_logprobs(self, out: RequestOutput) -> RequestOutput:
        """The engine's TokenLogprobs become vLLM's shape: per position a dict token id ->
        Logprob, the sampled (or prompt) token first, then the top ones ranked 1, 2, ... (a
        sampled token among them keeps the top entry, as in vLLM). A rank is 1 + the tokens more
        likely than it; vLLM also counts exact ties ahead of it. Done here, not in the engine, so
        the server's path keeps its compact entries."""
        if out.prompt_logprobs is not None:
            out.prompt_logprobs = [self._logprob_dict(e) for e in out.prompt_logprobs]
        for completion in out.outputs:
            if completion.logprobs is not None:
                completion.logprobs = [self._logprob_dict(e) for e in completion.logprobs]
        return out

    def _logprob_dict(self, entry) -> dict[int, Logprob] | None:
        if entry is None:  # the first prompt token has nothing before it
            return None
        texts = self._token_texts

        def text(token: int) -> str:
            return texts[token] if 0 <= token < len(texts) else ""

        position = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id))}
        for rank, (token, logprob) in enumerate(entry.top, 1):
            position[token] = Logprob(logprob, rank, text(token))
        return position

    @cached_property
    def _token_texts(self) -> list[str]:
        """Each token's own text, as the server's logprobs show it (an incomplete UTF-8
        sequence as U+FFFD)."""
        from pageserve.grammar.vocabulary import token_byte_table

        return [b.decode("utf-8", errors="replace") for b in token_byte_table(self.tokenizer)]


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int)


def _unpack(prompt: Prompt) -> tuple[str | list[int], str | None, object]:
    """(text or ids, cache salt, the images of multi_modal_data or None)."""
    if not isinstance(prompt, dict):
        return prompt, None, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids' "
                         f"(and optionally 'cache_salt', 'multi_modal_data'); got keys {sorted(prompt)}")
    images = None
    data = prompt.get("multi_modal_data")
    if data is not None:
        if not isinstance(data, dict) or set(data) != {"image"}:
            raise ValueError(f"multi_modal_data takes {{'image': PIL image or a list of them}}, got {data!r:.80}")
        images = data["image"]
    return prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("cache_salt"), images
