"""``LLM``: offline batches through the engine, with a progress bar."""
from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .request import Request
from .sampling_params import SamplingParams


class LLM:
    """Generate for many prompts at once; they are batched continuously inside the engine.

    >>> from hearth_llm.engine import LLM, SamplingParams
    >>> llm = LLM()                                   # SmolLM2-135M-Instruct, bundled
    >>> outs = llm.generate(["The sky is", "Paris is"], SamplingParams(temperature=0, max_tokens=16))
    >>> print(outs[0].outputs[0].text)
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].outputs[0].text
    'The capital of France is Paris.'

    Keyword arguments are :class:`EngineConfig` fields (``max_num_seqs=``, ``kv_cache_memory=``, ...).
    """

    def __init__(self, model: str = "default", **engine_kwargs) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Invalid input raises before anything is queued."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts")
        request_ids = self._add_all(prompt_list, params_list, priorities)
        self._run_until_done(request_ids, use_tqdm)
        return [self._collect(request_id) for request_id in request_ids]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            render_chat(self.tokenizer, conversation, add_generation_prompt, chat_template_kwargs)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        """Scheduler and KV cache counters: running/waiting, free/total blocks, preemptions, prefix hits."""
        return self.engine.stats()

    def _params_for(self, prompts, sampling_params):
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        return params

    def _add_all(self, prompts, params_list, priorities) -> list[str]:
        # Validate everything first so a bad prompt late in the list queues nothing.
        for prompt, params in zip(prompts, params_list):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
            params.validate()
            _, token_ids = self.engine._tokenize_prompt(prompt)
            self.engine._check_token_ids(token_ids)
        request_ids = []
        try:
            for prompt, params, priority in zip(prompts, params_list, priorities):
                request_ids.append(self.engine.add_request(prompt, params, priority=priority))
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
                self.engine.release(request_id)
            raise
        return request_ids

    def _run_until_done(self, request_ids: list[str], use_tqdm: bool) -> None:
        pending = set(request_ids)
        groups = self.engine.groups
        started = time.perf_counter()
        num_generated = 0
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            try:
                while pending:
                    for delta in self.engine.step():
                        num_generated += len(delta.new_token_ids)
                        group_id = delta.request.group_id
                        if delta.is_finished and group_id in pending and _all_finished(groups[group_id]):
                            pending.discard(group_id)
                            bar.update()
                    elapsed = time.perf_counter() - started
                    bar.set_postfix_str(f"{num_generated / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
            except BaseException:
                for request_id in pending:
                    self.engine.abort_request(request_id)
                raise

    def _collect(self, request_id: str) -> RequestOutput:
        children = self.engine.groups[request_id]
        first = children[0]
        outputs = [_completion(child, self.engine.detokenizers[child.request_id].text) for child in children]
        result = RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=outputs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=first.prompt_logprobs or None,
            finished=True,
        )
        self.engine.release(request_id)
        return result


def render_chat(tokenizer, conversation, add_generation_prompt=True, chat_template_kwargs=None) -> str:
    """The conversation as the model's chat template renders it (a string prompt)."""
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts (or a list of such lists)")
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))


def _completion(request: Request, text: str) -> CompletionOutput:
    return CompletionOutput(
        index=request.sample_index,
        text=text,
        token_ids=request.output_token_ids,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=request.logprobs if request.sampling_params.logprobs is not None else None,
    )


def _all_finished(children: list[Request]) -> bool:
    return all(child.is_finished for child in children)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("prompts: a flat list of ints is ambiguous; pass [[ids...]] for one tokenized prompt")
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("prompts must not be empty")
    return prompt_list
